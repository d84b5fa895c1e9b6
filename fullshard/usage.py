"""What the command line's subcommands share: the strategies they accept, the one-line usage error, the checks
of the arguments they have in common, and how they print bytes."""
from __future__ import annotations

from fullshard.plan.group import Strategy

STRATEGIES = [s.value for s in Strategy]


class UsageError(Exception):
    """A bad argument: reported as one line, exit status 2, no traceback."""


def check_common(args, precisions: tuple[str, ...] = ("fp32", "bf16")) -> None:
    if args.strategy not in STRATEGIES:
        raise UsageError(f"unknown --strategy {args.strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if args.mixed_precision not in precisions:
        raise UsageError(f"unknown --mixed-precision {args.mixed_precision!r}; choose {' or '.join(precisions)}")
    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")


def format_bytes(nbytes: float) -> str:
    return f"{nbytes / 2**30:10.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:10.2f} MiB"


def require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError("--hf-config needs the transformers package: pip install transformers") from None
