"""What an XLA-compiled program needs in memory, as `logitless bench jax` and its Tokamax rows report it:
`memory_of`, the byte counts of ``compiled.memory_analysis()``."""

from __future__ import annotations

MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")


def memory_of(compiled) -> dict:
    """A compiled program's temporary, argument, output and alias bytes, by their `MEMORY_FIELDS` names."""
    analysis = compiled.memory_analysis()
    return {field: int(getattr(analysis, field)) for field in MEMORY_FIELDS}
