"""The ``ringleader`` commands that talk to a Ray cluster's job server: ``submit``, ``status``,
``logs``, ``stop`` (``orchestrator/commands/submit.py`` does the work).

Exit codes as ``ringleader run``'s: 0 succeeded (or done), 1 the job failed, 2 bad input or the
cluster refused or could not be reached, 130 the job was stopped (or following it interrupted).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from orchestrator.commands.submit import Cluster

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
CLUSTER_COMMANDS = ("submit", "status", "logs", "stop")


def add_cluster_commands(commands: argparse._SubParsersAction, set_help: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the job-server commands to the ``ringleader`` parser; ``set_help`` adds ``--set``."""
    submit = commands.add_parser("submit", help="submit a job to a Ray cluster (ray job submit, with the project)")
    submit.add_argument("job", help="job file (YAML), inside the working directory")
    submit.add_argument("--run-dir", help="where the run goes, on the cluster (a shared path, to keep it)")
    submit.add_argument("--working-dir", type=Path, default=Path("."), help="uploaded with the job (default: .)")
    submit.add_argument("--follow", action="store_true", help="stream the logs; exit with the job's outcome")
    set_help(submit)
    for name, text in (
        ("status", "a submitted job's status"),
        ("logs", "a submitted job's logs"),
        ("stop", "stop a submitted job"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("submission_id", metavar="ID")
        if name == "logs":
            command.add_argument("--follow", action="store_true", help="stream until the job ends")
    for name in CLUSTER_COMMANDS:
        command = commands.choices[name]
        command.add_argument("--address", help="the job server, http://HEAD:8265 (default: RAY_ADDRESS, else local)")
        command.add_argument("--token-file", type=Path, help="the cluster's token (default: where Ray keeps it)")
        command.add_argument(
            "--timeout", type=float, metavar="SECONDS",
            help="how long to wait for each answer of the job server (default: 30)",
        )


def run_cluster_command(args: argparse.Namespace, err: Callable[[str], None]) -> int:
    from jobspec.fields import ConfigError
    from orchestrator.commands.submit import EXIT_CODES, REQUEST_TIMEOUT_S, Cluster, SubmissionError

    try:
        if args.timeout is not None and not args.timeout > 0:
            raise SubmissionError(f"--timeout: expected a number of seconds > 0, got {args.timeout:g}")
        cluster = Cluster(args.address, args.token_file, args.timeout or REQUEST_TIMEOUT_S)
        if args.command == "submit":
            return _submit(cluster, args, err)
        if args.command == "status":
            status, message = cluster.status(args.submission_id)
            print(f"{args.submission_id}: {status}" + (f" ({message})" if message else ""))
            return 0
        if args.command == "stop":
            stopped = cluster.stop(args.submission_id)
            print(f"{args.submission_id}: {'stopping' if stopped else 'already ended'}")
            return 0
        if args.follow:
            return EXIT_CODES[cluster.follow(args.submission_id, _write)]
        _write(cluster.logs(args.submission_id))
        return 0
    except (SubmissionError, ConfigError) as error:
        err(str(error))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        following = getattr(args, "follow", False) and args.command in ("submit", "logs")
        err("stopped following; the job goes on (ringleader stop ID stops it)" if following else "interrupted")
        return EXIT_INTERRUPTED


def _submit(cluster: Cluster, args: argparse.Namespace, err: Callable[[str], None]) -> int:
    from orchestrator.commands.submit import EXIT_CODES, job_entrypoint, job_path_within, runtime_env, shipped_overrides
    from orchestrator.job.reading import load_job

    working_dir: Path = args.working_dir
    job_file = job_path_within(Path(args.job), working_dir)
    # Validated here: a bad field fails before anything is uploaded. The cluster runs the job
    # in the working directory, whose modules the job may name: so they import here too.
    sys.path.insert(0, str(working_dir.resolve()))
    job = load_job(working_dir / job_file, list(args.overrides), resolve=False)
    private = (cluster.token.path,) if cluster.token and cluster.token.path else ()
    with shipped_overrides(working_dir, list(args.overrides)) as overrides_file:
        submission_id = cluster.submit(
            job_entrypoint(job_file, overrides_file, args.run_dir),
            runtime_env(working_dir, private, overrides_file),
            {"ringleader_job": job.name},
        )
    print(submission_id, flush=True)
    if not args.follow:
        return 0
    status = cluster.follow(submission_id, _write)
    if status != "SUCCEEDED":
        err(f"{submission_id} ended {status}")
    return EXIT_CODES[status]


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
