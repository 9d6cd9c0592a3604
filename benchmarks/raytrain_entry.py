"""Ray Train ``TorchTrainer`` with stock ``prepare_model`` (DDP, gloo on CPU) on a local Ray."""

from __future__ import annotations

import tempfile
from typing import Any

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model

from benchmarks.ddp_loop import train_ddp, write_result
from benchmarks.entry_args import entry_parser, read_job
from jobspec.job import JobConfig


def _loop(config: dict[str, Any]) -> None:
    job = JobConfig.model_validate_json(config["job"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    result = train_ddp(job, rank, world, prepare_model)
    if rank == 0:
        write_result(result, config["result"], config["model"])


def main() -> None:
    parser = entry_parser(
        __doc__.splitlines()[0], result="where rank 0 writes its JSON", model="where rank 0 saves its final parameters"
    )
    args = parser.parse_args()
    job_json, job = read_job(args)
    ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    try:
        with tempfile.TemporaryDirectory() as storage:
            trainer = TorchTrainer(
                _loop,
                train_loop_config={"job": job_json, "result": args.result, "model": args.model},
                scaling_config=ScalingConfig(
                    num_workers=job.scaling.workers,
                    use_gpu=False,
                    resources_per_worker=dict(job.scaling.resources_per_worker),
                ),
                run_config=RunConfig(storage_path=storage, name="bench"),
            )
            trainer.fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
