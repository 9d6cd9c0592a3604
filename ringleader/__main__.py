"""``python -m ringleader``: the ``ringleader`` command (``ringleader/cli.py``)."""

import sys

from ringleader.cli import main

sys.exit(main())
