"""Run under ``python -m torch.distributed.run --standalone``: DDP on gloo, rank 0 writes results."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.ddp_loop import train_ddp, write_result
from jobspec.job import JobConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True, help="job as JSON")
    parser.add_argument("--result", required=True, help="where rank 0 writes its JSON")
    args = parser.parse_args()
    job = JobConfig.model_validate_json(Path(args.job).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = train_ddp(job, rank, world, DistributedDataParallel)
    if rank == 0:
        write_result({**result, "pid": os.getpid()}, args.result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
