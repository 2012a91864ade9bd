"""`python -m benchmarks ...`, what `mtplx bench ...` runs."""

import sys

from benchmarks.cli import main

sys.exit(main())
