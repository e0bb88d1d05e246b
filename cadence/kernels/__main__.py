"""`python -m cadence.kernels`: build the CPU kernels ahead of time."""

import sys

from cadence.kernels import main

sys.exit(main())
