"""Where the repository is, for tests in any tier's folder."""

from pathlib import Path

#: The repository's root (this file is ``tests/helpers/paths.py``).
REPO = Path(__file__).resolve().parents[2]
