"""`python -m benchmarks.soak`."""

import sys

from benchmarks.soak.cli import main

sys.exit(main())
