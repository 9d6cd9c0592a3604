"""Run under ``python -m torch.distributed.run --standalone``: DDP on gloo, rank 0 writes results."""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.ddp_loop import train_ddp, write_result
from benchmarks.entry_args import entry_parser, read_job


def main() -> None:
    args = entry_parser(__doc__.splitlines()[0], result="where rank 0 writes its JSON").parse_args()
    _, job = read_job(args)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = train_ddp(job, rank, world, DistributedDataParallel)
    if rank == 0:
        write_result({**result, "pid": os.getpid()}, args.result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
