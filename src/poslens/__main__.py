"""`python -m poslens` runs the CLI."""

import sys

from poslens.cli import main

sys.exit(main())
