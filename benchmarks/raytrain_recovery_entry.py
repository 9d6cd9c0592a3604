"""Ray Train's half of the recovery benchmark: one worker is SIGKILLed mid-step, and Ray Train's
``FailureConfig`` restarts the worker group from the latest reported checkpoint.

Run as ``python -m benchmarks.raytrain_recovery_entry --job JOB.json --result OUT.json
--kill-step K --kill-rank R --checkpoint-every N [--model FILE]`` (rank 0 saves its final
parameters to FILE with ``torch.save``). It trains the job exactly as
``benchmarks.ddp_loop.train_ddp`` does (stock DDP through ``prepare_model``, same data, batch
and optimizer), with three additions a Ray Train user would write:

* every ``N`` completed steps, every rank calls ``ray.train.report``; rank 0 attaches a checkpoint
  (model and optimizer state, and ``step``: the number of steps completed, which is also the
  index of the next step to run) and the others report without one, as the Ray Train docs say;
* on start, the loop resumes from ``ray.train.get_checkpoint()`` when there is one. The job's
  sampler is indexed by step, so step ``t`` sees the same samples as in an uninterrupted run;
* on the first attempt only, rank ``R`` records the time and SIGKILLs itself in step ``K``,
  after that step's forward/backward and before its optimizer step.

Step numbers are 0-based. A checkpoint is taken after step ``s`` when ``(s + 1) % N == 0`` and
records ``step = s + 1``; so with ``N = 10`` and ``K = 25`` the run resumes from the checkpoint
taken after steps 0..19, at step 20, and steps 20..24 (completed before the kill) are lost.

The result JSON (written by this process once ``fit()`` has returned) has:

* ``recovery_s``: time the first step of the new attempt completed, minus the time of the kill;
* ``restart_s``: time the new attempt's training loop started (checkpoint loaded), minus the kill;
* ``resumed_from``: the ``step`` of the checkpoint the new attempt started from (0: none);
* ``first_step_after``: the step that first completed after the kill (= ``resumed_from``);
* ``full_size_s``: the same as ``recovery_s`` (the whole group restarts); ``samples_dropped``:
  samples of steps the trained trajectory skipped (0: a restart redoes them);
* ``steps_lost``: ``K - resumed_from``, the committed steps recomputed. Rank 0 may also have
  finished step ``K`` itself (its all-reduce completed before rank ``R`` died), but rank ``R``
  never applied it, so it was never committed; ``steps_redone_rank0`` counts those too;
* ``wall_s``: seconds from this process's start (imports included) to the end of ``fit()``;
  ``first_step_s``: from the same start to the first completed step;
* ``attempts``, ``final_loss`` (eval loss when the job has eval data, else rank 0's share of the
  last step's training loss), ``eval`` and ``steps`` (rank 0's ``[step, time, attempt]`` for every completed step).
"""

from __future__ import annotations

import time

# Before the heavy imports: the wall time a user waits for includes them.
_ENTRY_STARTED = time.time()

import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
from ray.train import (  # noqa: E402
    Checkpoint,
    CheckpointConfig,
    CheckpointConsistencyMode,
    FailureConfig,
    RunConfig,
    ScalingConfig,
)
from ray.train.torch import TorchTrainer, prepare_model  # noqa: E402

from benchmarks.ddp_loop import train_ddp  # noqa: E402
from benchmarks.entry_args import entry_parser, read_job  # noqa: E402
from jobspec.durable import read_jsonl  # noqa: E402
from jobspec.job import JobConfig  # noqa: E402
from workers.data.sampler import ShardSampler  # noqa: E402

# Files in the scratch directory, shared by the driver and the workers (one machine).
STATE_FILE = "state.pt"  # inside each checkpoint directory
KILL_FILE = "kill.json"  # written by rank R just before it kills itself: the first-attempt marker
STEP_LOG = "steps.jsonl"  # rank 0's start and step-completion records, one JSON object a line
EVAL_FILE = "eval.json"  # rank 0's final metrics

def append_json_line(path: Path, record: dict[str, Any]) -> None:
    # One write per record, in the kernel's hands once the file is closed: the driver reads it
    # after the workers are gone, and a SIGKILLed process must not take buffered records with it.
    # (No fsync: the machine does not crash here, and a step should cost what train_ddp's does.)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _loop(config: dict[str, Any]) -> None:
    """The Ray Train worker function (one attempt of it)."""
    job = JobConfig.model_validate_json(config["job"])
    scratch = Path(config["scratch"])
    kill_step, kill_rank, every = config["kill_step"], config["kill_rank"], config["checkpoint_every"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()

    start_step, state = 0, None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = torch.load(Path(directory) / STATE_FILE, weights_only=True)
        start_step = int(state["step"])

    step_log = scratch / STEP_LOG
    attempt = 0
    if rank == 0:
        # Only rank 0 writes the log, so counting its own start records numbers the attempts.
        attempt = 1 + sum(r["event"] == "start" for r in read_jsonl(step_log))
        append_json_line(step_log, {"event": "start", "attempt": attempt, "resumed_from": start_step, "time": time.time()})
    # The kill file is the marker: once rank R has died, a restarted rank R finds it and trains on.
    kill_armed = rank == kill_rank and not (scratch / KILL_FILE).exists()
    last_loss: list[torch.Tensor] = []

    def after_backward(step: int) -> None:
        if not (kill_armed and step == kill_step):
            return
        # Wait until the controller has committed every checkpoint reported so far. Reports reach
        # it on its next poll (every 2 s by default); without this wait a checkpoint reported a
        # few milliseconds before the kill could be lost with the worker, and steps_lost would
        # measure that race instead of the checkpoint interval. Waiting here is before the kill
        # time is taken, so it is not counted in recovery_s.
        ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
        append_json_line(scratch / KILL_FILE, {"time": time.time(), "step": step, "rank": rank})
        os.kill(os.getpid(), signal.SIGKILL)

    def after_step(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, done: float) -> None:
        if rank == 0:
            append_json_line(step_log, {"event": "step", "step": step, "time": done, "attempt": attempt})
        last_loss[:] = [loss]  # kept as a tensor: no extra work per step
        if (step + 1) % every:
            return
        # ray.train.report is a barrier: every rank calls it, only rank 0 attaches the files.
        metrics = {"step": step + 1, "train_loss": float(loss)}
        if rank == 0:
            with tempfile.TemporaryDirectory(dir=scratch) as directory:
                torch.save(
                    {"model": getattr(model, "module", model).state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                    Path(directory) / STATE_FILE,
                )
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))
        else:
            ray.train.report(metrics, checkpoint=None)

    result = train_ddp(
        job, rank, world, prepare_model,
        start_step=start_step, state=state, after_backward=after_backward, after_step=after_step,
    )
    metrics = result["eval"]
    if rank == 0:
        if config["model"]:
            torch.save(result["model"], config["model"])
        (scratch / EVAL_FILE).write_text(json.dumps({"eval": metrics, "train_loss": float(last_loss[0]) if last_loss else None}))


def summarize(scratch: Path, job: JobConfig, kill_step: int, wall_s: float) -> dict[str, Any]:
    """The result from the files the workers left in ``scratch``; RuntimeError when the run did
    not kill a worker, did not restart, or did not finish."""
    kills = read_jsonl(scratch / KILL_FILE)
    if not kills:
        raise RuntimeError(f"no worker was killed: the kill rank never reached step {kill_step} on the first attempt")
    killed_at = kills[0]["time"]
    records = read_jsonl(scratch / STEP_LOG)
    starts = [r for r in records if r["event"] == "start"]
    steps = [r for r in records if r["event"] == "step"]
    if len(starts) < 2:
        raise RuntimeError(f"Ray Train did not restart the worker group after the kill ({len(starts)} attempt(s) logged)")
    restart = starts[1]
    after = [r for r in steps if r["attempt"] >= restart["attempt"]]
    if not after:
        raise RuntimeError("the restarted attempt completed no step")
    if steps[-1]["step"] != (job.steps or 0) - 1:
        raise RuntimeError(f"training did not finish: last step logged {steps[-1]['step']}, job has {job.steps}")
    first = after[0]
    resumed_from = int(restart["resumed_from"])
    final = json.loads((scratch / EVAL_FILE).read_text()) if (scratch / EVAL_FILE).exists() else {}
    eval_metrics = final.get("eval") or {}
    # The trained trajectory: the first attempt's steps up to its checkpoint, then the restart's.
    trained = {r["step"] for r in steps if r["attempt"] < restart["attempt"] and r["step"] < resumed_from}
    trained |= {r["step"] for r in after}
    sampler = ShardSampler(1, job.batch_size, job.shards, job.seed)  # only batch sizes are read
    return {
        "recovery_s": first["time"] - killed_at,
        # The whole group restarts: its first step is at full size.
        "full_size_s": first["time"] - killed_at,
        "restart_s": restart["time"] - killed_at,
        "steps_lost": kill_step - resumed_from,
        "samples_dropped": sum(sampler.step_batch_size(s) for s in range(job.steps or 0) if s not in trained),
        "steps_redone_rank0": sum(1 for r in steps if r["attempt"] < restart["attempt"] and r["step"] >= resumed_from),
        "resumed_from": resumed_from,
        "first_step_after": first["step"],
        "kill_step": kill_step,
        "kill_time": killed_at,
        "attempts": len(starts),
        "wall_s": wall_s,
        "first_step_s": steps[0]["time"] - _ENTRY_STARTED,
        "final_loss": eval_metrics.get("loss", final.get("train_loss")),
        "eval": eval_metrics,
        "steps": [[r["step"], r["time"], r["attempt"]] for r in steps],
    }


def _check_args(job: JobConfig, kill_step: int, kill_rank: int, checkpoint_every: int) -> None:
    if job.steps is None:
        raise SystemExit("the recovery benchmark needs a job with 'steps' set (not 'epochs')")
    if not 0 <= kill_step < job.steps:
        raise SystemExit(f"--kill-step must be in [0, {job.steps}) for a {job.steps}-step job, got {kill_step}")
    if not 0 <= kill_rank < job.scaling.workers:
        raise SystemExit(f"--kill-rank must be in [0, {job.scaling.workers}), got {kill_rank}")
    if checkpoint_every < 1:
        raise SystemExit(f"--checkpoint-every must be >= 1, got {checkpoint_every}")


@contextlib.contextmanager
def _scratch_dir(path: str | None) -> Iterator[Path]:
    if path is None:
        with tempfile.TemporaryDirectory(prefix="rl-rtrec-") as directory:
            yield Path(directory)
        return
    scratch = Path(path)
    scratch.mkdir(parents=True, exist_ok=True)
    if any(scratch.iterdir()):
        # A kill file left from an earlier run would silently disarm the kill.
        raise SystemExit(f"--scratch {scratch} must be empty")
    yield scratch


def main(argv: list[str] | None = None) -> int:
    parser = entry_parser(
        __doc__.splitlines()[0], result="where to write the result JSON", model="where rank 0 saves its final parameters",
        kill=True, scratch="keep storage, checkpoints and logs here (empty dir; default: a temp dir)",
    )
    parser.add_argument("--checkpoint-every", type=int, required=True, help="report a checkpoint every N steps")
    args = parser.parse_args(argv)
    job_json, job = read_job(args)
    _check_args(job, args.kill_step, args.kill_rank, args.checkpoint_every)
    with _scratch_dir(args.scratch) as scratch:
        ray.init(address="local", include_dashboard=False, logging_level="WARNING")
        # A caller that times us out sends SIGTERM: exit through the finally, so the Ray this
        # process started is shut down rather than orphaned.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        try:
            trainer = TorchTrainer(
                _loop,
                train_loop_config={
                    "job": job_json,
                    "scratch": str(scratch),
                    "kill_step": args.kill_step,
                    "kill_rank": args.kill_rank,
                    "checkpoint_every": args.checkpoint_every,
                    "model": args.model,
                },
                scaling_config=ScalingConfig(
                    num_workers=job.scaling.workers,
                    use_gpu=False,
                    resources_per_worker=dict(job.scaling.resources_per_worker),
                ),
                run_config=RunConfig(
                    storage_path=str(scratch / "storage"),
                    name="recovery",
                    failure_config=FailureConfig(max_failures=1),
                    checkpoint_config=CheckpointConfig(num_to_keep=2),
                ),
            )
            trainer.fit()
            wall_s = time.time() - _ENTRY_STARTED
        finally:
            ray.shutdown()
        result = summarize(scratch, job, args.kill_step, wall_s)
    Path(args.result).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
