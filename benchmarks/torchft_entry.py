"""Ray Train ``TorchTrainer`` + ``TorchftConfig`` (torchft replica groups, one worker each) on a
local Ray: the fourth contender of the benchmarks.

Run as ``python -m benchmarks.torchft_entry --job JOB.json --result OUT.json [--model FILE]
[--kill-step K --kill-rank R --scratch DIR]``. The training loop is
``benchmarks.torchft_loop.train_torchft``. Without a kill the result is what
``benchmarks.throughput.run_once`` reads (replica 0's committed steps' end times and loss
weights, eval metrics). With one, worker ``R`` SIGKILLs itself in step ``K`` (after the step's
quorum started, before its forward) on its first life; Ray Train (``FailureConfig(max_failures=
1)``) replaces only that replica group, which heals from a live peer while the survivors train
on; every replica logs every step attempt to ``DIR``, and the result is ``summarize``'s.
``--model``: replica 0 saves its final parameters there (``torch.save`` of the state dict).
"""

from __future__ import annotations

import time

# Before the heavy imports: the wall time a user waits for includes them.
_ENTRY_STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import ray  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.collective import barrier  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402
from ray.train.v2.torch.torchft_config import TorchftConfig  # noqa: E402

from benchmarks.ddp_loop import write_result  # noqa: E402
from benchmarks.entry_args import entry_parser, read_job  # noqa: E402
from benchmarks.raytrain_recovery_entry import KILL_FILE, append_json_line  # noqa: E402
from benchmarks.torchft_loop import (  # noqa: E402
    LIGHTHOUSE_KWARGS,
    StepAttempt,
    check_torchft,
    torchft_shards,
    train_torchft,
)
from jobspec.durable import read_jsonl  # noqa: E402
from jobspec.job import JobConfig  # noqa: E402
from workers.data.sampler import ShardSampler  # noqa: E402

ATTEMPTS = "attempts-{replica}.jsonl"  # every step attempt of one replica (all its lives)


def _loop(config: dict[str, Any]) -> None:
    job = JobConfig.model_validate_json(config["job"])
    context = ray.train.get_context()
    replica, replicas = context.get_world_rank(), context.get_world_size()
    scratch = Path(config["scratch"]) if config["scratch"] else None
    kill_step = config["kill_step"]
    first_life = scratch is None or not (scratch / KILL_FILE).exists()
    armed = scratch is not None and replica == config["kill_rank"] and first_life

    def before_backward(step: int) -> None:
        if armed and step == kill_step:
            append_json_line(scratch / KILL_FILE, {"time": time.time(), "step": step, "rank": replica})
            os.kill(os.getpid(), signal.SIGKILL)

    def record(attempt: StepAttempt) -> None:
        append_json_line(scratch / ATTEMPTS.format(replica=replica), {**attempt.to_json(), "first_life": first_life})

    # Every first-life replica waits for the others once its manager heartbeats, so all take
    # part from step 0, as in the other contenders (a replacement comes alone: no barrier).
    result = train_torchft(
        job, replica, replicas, ready=barrier if first_life else None, before_backward=before_backward,
        record=record if scratch is not None else None,
    )
    if replica == 0:
        write_result(result, config["result"], config["model"])


def shard_samples(sampler: ShardSampler, step: int, shard: int) -> int:
    """How many samples shard ``shard`` of step ``step`` holds."""
    start, end = sampler.shard_bounds(step, shard)
    return end - start


def summarize(scratch: Path, job: JobConfig, kill_rank: int, wall_s: float) -> dict[str, Any]:
    """The recovery figures from the attempt logs in ``scratch``, over the trained trajectory:
    the first lives of all replicas, and a replacement once it healed from them.

    ``recovery_s``: kill to the first step a survivor committed; ``full_size_s``: kill to the
    first committed step all replicas took part in (None: never, before the run ended);
    ``steps_lost``: steps a replica committed again (a roll-back: torchft never does one);
    ``samples_dropped``: samples of the job's steps no participating replica computed (dead or
    healing), ``steps_dropped_from`` the steps they were in; ``split_brain``: a replacement
    came up after the survivors had finished, found nobody to heal from and trained on its own
    from step 0 (Ray's example warns of it; not counted in the trajectory). RuntimeError when
    no worker was killed or a step was never committed."""
    kills = read_jsonl(scratch / KILL_FILE)
    if not kills:
        raise RuntimeError("no worker was killed")
    killed_at, kill_step = kills[0]["time"], kills[0]["step"]
    workers, steps = job.scaling.workers, job.steps or 0
    attempts = [a for r in range(workers) for a in read_jsonl(scratch / ATTEMPTS.format(replica=r))]
    first_life = {a["pid"] for a in attempts if a["first_life"]}
    # A replacement's first commit heals it to the group's step; one that commits step 0 found
    # no group.
    lives = {a["pid"] for a in attempts}
    starts: dict[int, int] = {}  # each life's first committed step
    for a in attempts:
        if a["committed"]:
            starts[a["pid"]] = min(a["step"], starts.get(a["pid"], a["step"]))
    healed = {pid for pid, step in starts.items() if pid not in first_life and step >= kill_step}
    split = {pid for pid in starts if pid not in first_life | healed}
    trajectory = [a for a in attempts if a["pid"] in first_life | healed]
    committed = sorted((a for a in trajectory if a["committed"]), key=lambda a: a["time"])
    # By step, not time: a survivor may commit the step before the kill a moment after it.
    survivors = [a for a in committed if a["step"] >= kill_step and a["replica"] != kill_rank]
    if not survivors:
        raise RuntimeError("no survivor committed a step after the kill")
    full = [a for a in committed if a["step"] >= kill_step and a["participants"] == workers]
    sampler = ShardSampler(1, job.batch_size, job.shards, job.seed)  # only shard sizes are read
    dealt = {r: torchft_shards(job.shards, r, workers) for r in range(workers)}
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for a in committed:
        by_step[a["step"]].append(a)
    dropped, dropped_steps, unaccounted = 0, [], 0
    for step in range(steps):
        mine = by_step.get(step)
        if not mine:
            raise RuntimeError(f"step {step} was never committed")
        contributors = {a["replica"] for a in mine if a["participating"]}
        if any(a["data_step"] != step for a in mine if a["participating"]):
            raise RuntimeError(f"step {step}: a participating replica computed another step's samples")
        # A replica that took part but died before logging: counted as dropped, and flagged.
        unaccounted += max(a["participants"] for a in mine) - len(contributors)
        missing = sum(
            shard_samples(sampler, step, s)
            for r in range(workers) if r not in contributors
            for s in dealt[r]
        )
        if missing:
            dropped += missing
            dropped_steps.append(step)
    return {
        "recovery_s": survivors[0]["time"] - killed_at,
        "full_size_s": full[0]["time"] - killed_at if full else None,
        "steps_lost": len(committed) - len({(a["replica"], a["step"]) for a in committed}),
        "samples_dropped": dropped,
        "steps_dropped_from": dropped_steps,
        "unaccounted_participants": unaccounted,
        "split_brain": len(split),
        "failed_attempts": sum(1 for a in trajectory if not a["committed"]),
        "lives": len(lives),
        "wall_s": wall_s,
    }


def main(argv: list[str] | None = None) -> int:
    # The kill strikes in the first life only: a replacement does not die again.
    parser = entry_parser(
        __doc__.splitlines()[0], result="where to write the result JSON", model="where replica 0 saves its final parameters",
        kill=False, scratch="attempt logs and the kill marker (empty dir; default: a temp dir)",
    )
    args = parser.parse_args(argv)
    job_json, job = read_job(args)
    kill = args.kill_step is not None
    if kill and (args.kill_rank is None or not 0 < args.kill_step < (job.steps or 0)):
        # Not step 0: a replacement healing into step 0 would look like one that found nobody.
        raise SystemExit(f"--kill-step must be in (0, {job.steps}) and comes with --kill-rank")
    check_torchft(job)  # a clear error before any Ray starts
    with tempfile.TemporaryDirectory(prefix="rl-torchft-") as temp:
        scratch = Path(args.scratch or temp)
        scratch.mkdir(parents=True, exist_ok=True)
        if any(scratch.iterdir()):  # a kill file left there would disarm the kill
            raise SystemExit(f"--scratch {scratch} must be empty")
        result = Path(args.result)
        train_result = scratch / "train.json" if kill else result
        # A caller that times us out sends SIGTERM: exit through the finally (ray.shutdown()).
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        try:
            ray.init(address="local", include_dashboard=False, logging_level="WARNING")
            TorchTrainer(
                _loop,
                train_loop_config={
                    "job": job_json, "result": str(train_result), "model": args.model,
                    "scratch": str(scratch) if args.scratch or kill else None, "kill_step": args.kill_step, "kill_rank": args.kill_rank,
                },
                scaling_config=ScalingConfig(
                    num_workers=job.scaling.workers, use_gpu=False, resources_per_worker=dict(job.scaling.resources_per_worker),
                ),
                torch_config=TorchftConfig(lighthouse_kwargs=LIGHTHOUSE_KWARGS, backend="gloo"),
                run_config=RunConfig(
                    storage_path=str(scratch / "storage"), name="torchft",
                    failure_config=FailureConfig(max_failures=1 if kill else 0),
                ),
            ).fit()
            wall_s = time.time() - _ENTRY_STARTED
        finally:
            ray.shutdown()
        if kill:
            trained = json.loads(train_result.read_text())
            figures = summarize(scratch, job, args.kill_rank, wall_s)
            result.write_text(json.dumps({**figures, "eval": trained["eval"], "final_loss": trained["eval"].get("loss")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
