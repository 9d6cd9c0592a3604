"""Deprecated: ``python -m orchestrator.cli`` is ``python -m ringleader`` (the command line lives
in the top package, ``ringleader/cli.py``, above the driver).

Kept so jobs submitted by hand with the old entrypoint still run: it says so on stderr and
replaces this process with ``python -m ringleader`` and the same arguments (same PID, so Ray's
job supervisor, signals and the exit code are the new command's). It imports nothing of
ringleader's: the driver's package never imports the layer above it.
"""

from __future__ import annotations

import os
import sys

DEPRECATION = (
    "ringleader: 'python -m orchestrator.cli' is deprecated and will be removed; "
    "use 'python -m ringleader' (or the 'ringleader' command) with the same arguments"
)


def forward(argv: list[str]) -> None:
    """Print the deprecation and exec ``python -m ringleader *argv``; does not return."""
    print(DEPRECATION, file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "ringleader", *argv])


if __name__ == "__main__":
    forward(sys.argv[1:])
