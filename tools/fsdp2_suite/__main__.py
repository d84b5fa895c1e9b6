"""Entry point: ``python tools/fsdp2_suite ...`` (see the package docstring in ``__init__.py``)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a folder: make the folder above it the import root, not the folder itself
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import fsdp2_suite  # noqa: E402
from fsdp2_suite import driver, results  # noqa: E402

DEFAULT_SCRATCH = Path(os.environ.get("FSDP2_SUITE_SCRATCH", driver.PACKAGE_PARENT.parent / ".fsdp2-suite"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp2_suite", description=fsdp2_suite.__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="upstream test files (names or paths); default: all test_*.py")
    parser.add_argument("--impl", choices=("torch", "fullshard"), default="torch")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--upstream", default=str(DEFAULT_SCRATCH / "upstream"))
    parser.add_argument("--out", default=str(DEFAULT_SCRATCH / "results"))
    parser.add_argument("--deps", default=str(DEFAULT_SCRATCH / "deps"),
                        help="extra site folder (e.g. expecttest for torch.testing._internal)")
    parser.add_argument("--fullshard-path", default=os.environ.get("FSDP2_SUITE_FULLSHARD_PATH", ""),
                        help="folder put before the installed fullshard on PYTHONPATH")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per test")
    parser.add_argument("--file-timeout", type=int, default=3600, help="seconds per pytest process")
    parser.add_argument("--vgpus", type=int, default=2, help="accelerators world_size properties see (at least)")
    parser.add_argument("--max-ranks", type=int, default=8, help="largest skip_if_lt_x_gpu(x) let through")
    parser.add_argument("--max-attempts", type=int, default=60)
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    parser.add_argument("--skip-from", help="results JSON of another run (e.g. the torch baseline)")
    parser.add_argument("--skip-outcomes", default="timeout",
                        help="with --skip-from: comma list of its outcomes whose tests are not run here")
    parser.add_argument("--compare", nargs=2, metavar=("TORCH_JSON", "FULLSHARD_JSON"))
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="OUT IN1 [IN2 ...]: merge result files (later ones win per test)")
    args = parser.parse_args(argv)

    if args.merge:
        results.merge(Path(args.merge[0]), [Path(p) for p in args.merge[1:]])
        return 0
    if args.compare:
        results.compare(Path(args.compare[0]), Path(args.compare[1]))
        return 0

    upstream = Path(args.upstream)
    if args.files:
        files = [Path(f) if Path(f).is_file() else upstream / f for f in args.files]
    else:
        files = sorted(upstream.glob("test_*.py"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        parser.error(f"no such upstream file: {missing}")
    # Each pytest process runs in its file's folder: relative paths given here would not resolve there.
    for name in ("out", "deps", "fullshard_path"):
        if getattr(args, name):
            setattr(args, name, str(Path(getattr(args, name)).resolve()))
    driver.run(args, [f.resolve() for f in files])
    return 0


if __name__ == "__main__":
    sys.exit(main())
