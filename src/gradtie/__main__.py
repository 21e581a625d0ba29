import sys

from .cli import main

# guarded: the input pipeline's worker processes start by spawning, and re-import the main module
if __name__ == "__main__":
    sys.exit(main())
