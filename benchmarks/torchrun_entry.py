"""Run under ``python -m torch.distributed.run --standalone``: DDP on gloo, rank 0 writes results.

``--variant`` picks the peer (``benchmarks/sharded_peers.py``): ``ddp`` (stock DDP, the
default), ``zero`` (DDP + ``ZeroRedundancyOptimizer``) or ``fsdp2`` (``fully_shard``).
``--peak-step S``: rank 0 measures step ``S`` (``StepPeak``: the state held at its start plus
the step's peak above it) and writes it as ``memory``, with its optimizer state's bytes; the
timed steps are then those after it (``step_ends`` starts at the end of step ``S``), so the
profiler's cost is not in the samples/s.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from benchmarks.ddp_loop import train_ddp, write_result
from benchmarks.entry_args import entry_parser, read_job
from benchmarks.sharded_peers import VARIANTS, StepPeak, variant


def main() -> None:
    parser = entry_parser(__doc__.splitlines()[0], result="where rank 0 writes its JSON")
    parser.add_argument("--variant", choices=VARIANTS, default="ddp", help="which peer trains (default: stock DDP)")
    parser.add_argument("--peak-step", type=int, help="rank 0 measures this step's memory (>= 1); timing starts after it")
    args = parser.parse_args()
    _, job = read_job(args)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    wrap, make_optimizer = variant(args.variant)
    meter = StepPeak(args.peak_step) if args.peak_step is not None and rank == 0 else None
    result = train_ddp(job, rank, world, wrap, after_step=meter, make_optimizer=make_optimizer)
    if rank == 0:
        if args.peak_step is not None:
            first = args.peak_step
            result.update(step_ends=result["step_ends"][first:], step_weights=result["step_weights"][first:])
        if meter is not None:
            result["memory"] = meter.as_dict()
        write_result({**result, "pid": os.getpid(), "variant": args.variant}, args.result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
