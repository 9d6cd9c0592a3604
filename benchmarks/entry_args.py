"""The command line the contenders' entry scripts share (``raytrain_entry``,
``raytrain_recovery_entry``, ``torchft_entry``, ``torchrun_entry``): the job as a JSON file,
where the result goes, and for the optional parts (final model, a kill, a scratch directory)
the same flags with the same meaning in each."""

from __future__ import annotations

import argparse
from pathlib import Path

from jobspec.job import JobConfig


def entry_parser(
    description: str, *, result: str, model: str | None = None, kill: bool | None = None, scratch: str | None = None,
) -> argparse.ArgumentParser:
    """A parser with ``--job`` and ``--result`` (help ``result``), and, where asked for,
    ``--model`` (help ``model``), ``--kill-step``/``--kill-rank`` (required when ``kill`` is
    True, optional when False, absent when None) and ``--scratch`` (help ``scratch``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--job", required=True, help="the job as a JSON file (JobConfig)")
    parser.add_argument("--result", required=True, help=result)
    if model is not None:
        parser.add_argument("--model", help=model)
    if kill is not None:
        parser.add_argument("--kill-step", type=int, required=kill, help="0-based step in which --kill-rank dies")
        parser.add_argument("--kill-rank", type=int, required=kill, help="the rank that SIGKILLs itself")
    if scratch is not None:
        parser.add_argument("--scratch", help=scratch)
    return parser


def read_job(args: argparse.Namespace) -> tuple[str, JobConfig]:
    """The ``--job`` file's JSON text (to hand on to workers as it is) and the job it validates to."""
    text = Path(args.job).read_text()
    return text, JobConfig.model_validate_json(text)
