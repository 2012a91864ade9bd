"""`python -m benchmarks.load`."""

import sys

from benchmarks.load.cli import main

sys.exit(main())
