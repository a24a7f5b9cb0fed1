"""``python -m clew``: the ``clew`` command where the package is importable but not installed."""

import sys

from clew.cli import main

sys.exit(main())
