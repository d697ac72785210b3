"""The TRL releases `logitless.trl` is built against: it answers TRL's own fused-LM-head call and overrides
a few GRPOTrainer internals, so another minor release is refused at import with a clear message."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

SUPPORTED_TRL = (Version("1.16"), Version("1.17"))  # [lowest, first unsupported)


def check_trl_version(installed: str | None = None) -> None:
    """Raise ImportError unless the installed TRL (or ``installed``) is in `SUPPORTED_TRL`."""
    low, high = SUPPORTED_TRL
    if installed is None:
        try:
            installed = version("trl")
        except PackageNotFoundError:
            raise ImportError(f'logitless.trl needs TRL >={low},<{high}: pip install "logitless[trl]"') from None
    if not low <= Version(installed) < high:
        raise ImportError(f"logitless.trl supports TRL >={low},<{high}, found {installed}: "
                          f'pip install "logitless[trl]" installs a supported release')
