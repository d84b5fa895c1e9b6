"""``python -m fullshard.bench`` is ``fullshard bench``."""
import sys

from fullshard.bench import main

if __name__ == "__main__":
    sys.exit(main())
