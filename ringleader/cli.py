"""``ringleader`` command line.

Exit codes: 0 finished, 1 the job failed, 2 bad input (job file, overrides, run directory),
130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from ringleader.cli_bench import add_bench_commands, run_bench
from ringleader.cli_cluster import CLUSTER_COMMANDS, add_cluster_commands, run_cluster_command

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringleader", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a training job (the built-in example without JOB)")
    run.add_argument("job", nargs="?", help="job file (YAML); omit for the built-in digits example")
    run.add_argument("--run-dir", help="where events, telemetry, model and summary go")
    _add_launch_options(run, "e.g. --set steps=50 --set scaling.workers=3")

    resume = commands.add_parser(
        "resume", help="go on with a run from its last good checkpoint (on any worker count)"
    )
    resume.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds job.json)")
    _add_launch_options(resume, "e.g. --set steps=600 to train longer")

    add_cluster_commands(commands, _add_overrides)

    tune = commands.add_parser("tune", help="a Ray Tune sweep whose trials are elastic ringleader jobs")
    tune.add_argument("job", nargs="?", help="job file (YAML); omit for the built-in example")
    tune.add_argument(
        "--param", action="append", default=[], metavar="FIELD=DIST(ARGS)",
        help="a searched field: uniform|loguniform|randint(low,high), choice(a,b,...), grid(a,b,...); repeatable",
    )
    tune.add_argument("--samples", type=int, default=1, help="trials per grid point (default 1)")
    tune.add_argument("--scheduler", choices=["asha"], help="stop bad trials early (ASHA, on the step)")
    tune.add_argument("--address", help="Ray cluster to join; default: start a local Ray")
    tune.add_argument("--storage", default="runs/tune", help="where Tune's results and the trials' runs go")
    _add_overrides(tune)

    report = commands.add_parser("report", help="one HTML page with plots of a run (loss, speed, workers, goodput)")
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.add_argument("--out", metavar="DIR", help="where report.html goes (default: the run directory)")

    simulate = commands.add_parser(
        "simulate", help="discrete-event simulation of N workers: ringleader's policies vs no mitigation and restart-the-world"
    )
    simulate.add_argument("scenario", metavar="SCENARIO", help="scenario file (YAML), e.g. examples/sim-4096.yaml")
    simulate.add_argument("--json", dest="json_path", metavar="FILE", help="write every contender's figures as JSON")
    simulate.add_argument("--plot", dest="plot_path", metavar="FILE", help="write a PNG: progress over time, recovery times")
    _add_overrides(simulate, "e.g. --set workers=1024")

    plan = commands.add_parser(
        "plan", help="memory per rank (parameters, gradients, optimizer state, activations) under each sharding setting"
    )
    plan.add_argument("job", nargs="?", help="job file (YAML); omit for the built-in example")
    plan.add_argument("--device-memory", metavar="SIZE", help="one device's memory, e.g. 80GiB: what fits, the largest pass")
    plan.add_argument("--group-sizes", type=int, nargs="+", default=[1, 2, 4], help="sharding group sizes (default: 1 2 4)")
    plan.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="overrides the job's precision")
    plan.add_argument("--samples-per-pass", type=int, help="samples in one pass (default: the job's own)")
    plan.add_argument("--device", choices=["cpu", "cuda"], help="where the probe measures (default: where workers train)")
    plan.add_argument("--probe-samples", type=int, nargs=2, metavar=("B1", "B2"), help="the probe's two pass sizes")
    plan.add_argument("--target-params", metavar="COUNT", help="a model size to place, e.g. 7e9 or 7B (needs --device-memory)")
    plan.add_argument("--reserve", default="0", metavar="SIZE", help="with --target-params: memory kept for activations")
    plan.add_argument("--json", dest="json_path", metavar="FILE", help="write the plan as JSON (- for stdout, table omitted)")
    _add_overrides(plan)

    add_bench_commands(commands)
    return parser


def _add_launch_options(command: argparse.ArgumentParser, set_example: str) -> None:
    """The options ``run`` and ``resume`` share: where to run, how many workers, overrides."""
    command.add_argument("--workers", type=int, help="number of workers (overrides scaling.workers)")
    command.add_argument("--address", help="Ray cluster to join; default: start a local Ray")
    command.add_argument(
        "--local-nodes", type=int, default=0, metavar="N",
        help="start N simulated Ray nodes on this machine (try node loss, hierarchical all-reduce)",
    )
    _add_overrides(command, set_example)
    command.add_argument(
        "--set-file", metavar="FILE",
        help="overrides from a JSON list of FIELD=VALUE, before any --set (how ringleader submit ships its --set)",
    )
    command.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_overrides(command: argparse.ArgumentParser, example: str = "e.g. --set steps=50") -> None:
    command.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
        help=f"override a job field, {example}",
    )


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _err(message: str) -> None:
    """A one-line message for the user on stderr, credentials in URIs masked."""
    from jobspec.redaction import redact

    print(redact(f"ringleader: {message}"), file=sys.stderr)


def _cmd_run(args: argparse.Namespace) -> int:
    from jobspec.fields import ConfigError
    from orchestrator.job.reading import job_source, load_job, read_overrides
    from orchestrator.output.run_dir import JOB_FILE, RunDirectory

    # Like `python -m`: job files may name factories in modules next to where the user runs.
    sys.path.insert(0, os.getcwd())
    try:
        overrides = (read_overrides(args.set_file) if args.set_file else []) + list(args.overrides)
    except ConfigError as err:
        _err(f"{err}")
        return EXIT_BAD_INPUT
    if args.workers is not None:
        overrides.append(f"scaling.workers={args.workers}")
    if args.command == "resume":
        if not RunDirectory.is_run(Path(args.run_dir)):
            _err(f"{args.run_dir} is not a run directory (no {JOB_FILE})")
            return EXIT_BAD_INPUT
        args.job = str(Path(args.run_dir) / JOB_FILE)
    if args.run_dir is not None:
        overrides.append(f"run_dir={json.dumps(args.run_dir)}")
    try:
        # Checks that import torch and user code run in run_job, while Ray starts.
        job = load_job(args.job, overrides, resolve=False)
    except ConfigError as err:
        _err(f"{err}")
        return EXIT_BAD_INPUT

    from jobspec.redaction import redact
    from orchestrator.launch import LaunchTimeout, default_run_dir, run_job

    try:
        result = run_job(
            job,
            address=args.address,
            local_nodes=args.local_nodes,
            run_dir=default_run_dir(job),
            progress=not args.no_progress,
            source=job_source(args.job),
            warn=lambda message: _err(f"warning: {message}"),
        )
    except (ConfigError, FileExistsError) as err:
        _err(f"{err}")
        return EXIT_BAD_INPUT
    except LaunchTimeout as err:
        _err(f"job failed: {err}")
        return EXIT_FAILED
    summary = result.summary
    accuracy = summary["eval"].get("accuracy")
    shown = f", eval accuracy {accuracy:.4f}" if accuracy is not None else ""
    print(
        redact(f"ringleader: {summary['status']}: {summary['steps']} steps, "
        f"{summary['samples_per_s']:.0f} samples/s, final loss {summary['final_loss']}"
        f"{shown}, wall {summary['wall_s']:.1f}s; run dir {result.run_dir}")
    )
    if summary["status"] == "finished":
        return 0
    if summary["status"] == "stopped":
        return EXIT_INTERRUPTED
    _err(f"job failed: {summary.get('error')}")
    return EXIT_FAILED


def _cmd_tune(args: argparse.Namespace) -> int:
    from jobspec.fields import ConfigError
    from orchestrator.commands.tune import format_ranking, run_sweep
    from orchestrator.launch import ray_session

    sys.path.insert(0, os.getcwd())
    try:
        with ray_session(args.address):
            ranked = run_sweep(
                args.job, args.param, args.samples, scheduler=args.scheduler, overrides=args.overrides,
                storage=Path(args.storage),
            )
    except ConfigError as err:
        _err(str(err))
        return EXIT_BAD_INPUT
    print(format_ranking(ranked))
    return 0 if ranked and ranked[0]["status"] == "ok" else EXIT_FAILED


def _cmd_plan(args: argparse.Namespace) -> int:
    from jobspec.fields import ConfigError
    from orchestrator.commands.plan import PlanRequest, main
    from orchestrator.job.reading import load_job
    from policies.memory_plan import parse_bytes, parse_count

    sys.path.insert(0, os.getcwd())
    overrides = list(args.overrides) + ([f"precision={args.precision}"] if args.precision else [])
    try:
        job = load_job(args.job, overrides)
        request = PlanRequest(
            device_bytes=parse_bytes(args.device_memory) if args.device_memory else None,
            group_sizes=tuple(args.group_sizes), samples_per_pass=args.samples_per_pass,
            target_params=parse_count(args.target_params) if args.target_params else None,
            reserve_bytes=parse_bytes(args.reserve), probe_sizes=tuple(args.probe_samples) if args.probe_samples else None, device=args.device,
        )
        return main(job, request, args.json_path)
    except (ConfigError, ValueError) as err:
        _err(str(err))
        return EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if args.command in ("run", "resume"):
        return _cmd_run(args)
    if args.command in CLUSTER_COMMANDS:
        return run_cluster_command(args, _err)
    if args.command == "tune":
        return _cmd_tune(args)
    if args.command == "plan":
        return _cmd_plan(args)
    if args.command == "report":
        from orchestrator.commands.report import ReportError, write_report

        try:
            print(write_report(Path(args.run_dir), Path(args.out) if args.out else None))
        except ReportError as err:
            _err(str(err))
            return EXIT_BAD_INPUT
        return 0
    if args.command == "simulate":
        from jobspec.fields import ConfigError
        from simulator import output

        try:
            return output.main(args.scenario, args.overrides, args.json_path, args.plot_path)
        except (ConfigError, RuntimeError) as err:
            _err(str(err))
            return EXIT_BAD_INPUT
    if args.command == "bench":
        return run_bench(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
