"""``python -m fullshard`` is the ``fullshard`` command."""
import sys

from fullshard.cli import main

if __name__ == "__main__":
    sys.exit(main())
