"""Deprecated: ``python -m orchestrator.cli`` is ``python -m ringleader`` (the command line lives
in the top package, ``ringleader/cli.py``, above the driver).

Kept so jobs submitted by hand with the old entrypoint, and console scripts installed before
the move (``orchestrator.cli:main``), still run: it says so on stderr and replaces this process
with ``python -m ringleader`` and the same arguments (same PID, so Ray's job supervisor, signals
and the exit code are the new command's; the interpreter's own options, ``-X``, ``-u``, ``-W``,
carry over). It imports nothing of ringleader's: the driver's package never imports the layer
above it.
"""

from __future__ import annotations

import os
import sys

DEPRECATION = (
    "ringleader: 'python -m orchestrator.cli' is deprecated and will be removed; "
    "use 'python -m ringleader' (or the 'ringleader' command) with the same arguments"
)


def interpreter_options(orig_argv: list[str]) -> list[str]:
    """The interpreter's options in ``orig_argv`` (``sys.orig_argv``): what stands between the
    executable and ``-m`` (none if this module was not started with ``-m``)."""
    for index, arg in enumerate(orig_argv[1:], 1):
        if arg.startswith("-m"):
            return orig_argv[1:index]
    return []


def main(argv: list[str] | None = None) -> None:
    """Print the deprecation and exec ``python -m ringleader`` with ``argv`` (default: this
    process's arguments); does not return."""
    print(DEPRECATION, file=sys.stderr, flush=True)
    args = sys.argv[1:] if argv is None else argv
    os.execv(sys.executable, [sys.executable, *interpreter_options(sys.orig_argv), "-m", "ringleader", *args])


if __name__ == "__main__":
    main()
