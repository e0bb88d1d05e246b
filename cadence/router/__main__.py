"""`python -m cadence.router`: the same as `cadence router`."""

import sys

from cadence.router.cli import main

if __name__ == "__main__":
    sys.exit(main(None))
