"""Microbenchmarks: `logitless bench lmhead` (GRPO loss through the LM head, peers side by side)."""
