"""``ringleader bench``: the benchmarks' command line (each prints its figures side by side, from one run)."""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_commands(commands: Any) -> None:
    """``bench`` and its subcommands, added to ``commands`` (the top-level subparsers)."""
    bench = commands.add_parser("bench", help="benchmarks (side by side, one run)")
    benches = bench.add_subparsers(dest="bench", required=True)
    throughput = benches.add_parser(
        "throughput", help="clean samples/s, launch time and step overhead over plain DDP: vs Ray Train, Ray Train + torchft, torchrun"
    )
    throughput.add_argument("--workers", type=int, default=2)
    throughput.add_argument("--steps", type=int, default=100)
    throughput.add_argument("--repeats", type=int, default=3)
    throughput.add_argument(
        "--workload", action="append", choices=["digits", "tinylm", "gpt"],
        help="repeatable; default: digits and tinylm",
    )
    throughput.add_argument("--json", dest="json_path", metavar="FILE", help="write medians as JSON")

    control = benches.add_parser(
        "control-plane", help="driver CPU and store traffic per step vs worker count (null model), fitted to 4096"
    )
    control.add_argument("--workers", type=int, nargs="*", default=[4, 8, 16, 32, 64], help="worker counts (default: 4 8 16 32 64; none: synthetic only)")
    control.add_argument("--steps", type=int, default=60, help="steps per job (the first ones are warm-up)")
    control.add_argument("--json", dest="json_path", metavar="FILE", help="write the rows and the fit as JSON")
    control.add_argument(
        "--synthetic", type=int, nargs="+", metavar="RANKS",
        help="also run the real controller against a synthetic group of this many ranks each (no actors: "
        "the driver's own per-step work at scale), e.g. 1024 4096 16384",
    )
    control.add_argument(
        "--claim-stores", type=int, metavar="N", help="spread the real jobs' shard claims over N store processes "
        "(stragglers.claim_stores; default: the job's, one per 256 workers)",
    )

    allreduce = benches.add_parser("allreduce", help="all-reduce bandwidth: our ring (and hierarchical) vs native")
    allreduce.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="world sizes (default: 2 4)")
    allreduce.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16, 64], metavar="MB")
    allreduce.add_argument("--nodes", type=int, default=1, help="simulated nodes (>1 adds hierarchical)")
    allreduce.add_argument("--iters", type=int, default=10, help="timed rounds per size")
    allreduce.add_argument("--json", dest="json_path", metavar="FILE", help="write the rows as JSON")

    overlap = benches.add_parser("overlap", help="step time and exposed communication, overlap on vs off")
    overlap.add_argument("--workload", choices=["digits", "tinylm"], default="digits")
    overlap.add_argument("--workers", type=int, default=2)
    overlap.add_argument("--rounds", type=int, default=3, help="alternating on/off rounds")
    overlap.add_argument("--steps", type=int, default=20, help="steps per round")
    overlap.add_argument("--json", dest="json_path", metavar="FILE", help="write medians as JSON")

    straggler = benches.add_parser(
        "straggler", help="a slowed worker or random stalls: clean vs unmitigated vs mitigated vs Ray Train (+ torchft)"
    )
    straggler.add_argument("--kind", choices=["slow", "stall"], default="slow")
    straggler.add_argument("--workload", choices=["digits", "tinylm"], default="digits")
    straggler.add_argument("--workers", type=int, default=4)
    straggler.add_argument("--steps", type=int, default=100)
    straggler.add_argument("--factor", type=float, default=3.0, help="slow: how many times slower the last worker is")
    straggler.add_argument("--probability", type=float, default=0.02, help="stall: chance each worker-step stalls")
    straggler.add_argument("--stall-steps", type=float, default=20.0, help="stall: its length, in clean step times")
    straggler.add_argument("--during", choices=["fetch", "compute"], default="fetch", help="stall: where it strikes")
    straggler.add_argument("--seed", type=int, default=0, help="stall: seed of the draws")
    straggler.add_argument("--repeats", type=int, default=2)
    straggler.add_argument("--json", dest="json_path", metavar="FILE", help="write medians as JSON")

    recovery = benches.add_parser(
        "recovery",
        help="a worker SIGKILLed: seconds to commit again and to full size, steps and samples lost, exactness; "
        "ours vs Ray Train vs Ray Train + torchft; checkpoint cost",
    )
    recovery.add_argument("--workload", choices=["digits", "tinylm"], default="digits")
    recovery.add_argument("--workers", type=int, default=2)
    # Long enough after the kill for torchft's replacement (~5 s until the lighthouse gives up
    # on the dead, ~10 s for Ray Train to start its replacement here) to rejoin the survivors
    # before they finish (~370 steps x 40-50 ms).
    recovery.add_argument("--steps", type=int, default=500)
    recovery.add_argument("--kill-step", type=int, default=130, help="the step in which the last worker is killed")
    recovery.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints (ours, Ray Train)")
    recovery.add_argument("--exact-steps", type=int, default=60, help="steps of the exactness runs (short)")
    recovery.add_argument("--exact-kill-step", type=int, default=35, help="the kill's step in the exactness runs")
    recovery.add_argument("--repeats", type=int, default=3, help="runs of each checkpoint-overhead variant")
    recovery.add_argument("--overhead-steps", type=int, default=200, help="steps of each checkpoint-overhead run")
    recovery.add_argument("--json", dest="json_path", metavar="FILE", help="write the result as JSON")

    sharding = benches.add_parser(
        "sharding",
        help="sharded optimizer state at each group size: bytes and peak per rank (measured vs plan), samples/s "
        "vs ZeRO + DDP and FSDP2, recovery with replicas",
    )
    sharding.add_argument(
        "--workloads", nargs="+", choices=["tinylm", "gpt"], default=["tinylm", "gpt"], help="default: tinylm gpt"
    )
    sharding.add_argument("--group-sizes", type=int, nargs="+", default=[1, 2, 4], help="sharding.group_size values (default: 1 2 4)")
    sharding.add_argument("--workers", type=int, default=4)
    sharding.add_argument("--steps", type=int, default=30, help="steps per run (the recovery run kills a worker half way)")
    sharding.add_argument("--repeats", type=int, default=3, help="interleaved runs of each contender (medians)")
    sharding.add_argument("--json", dest="json_path", metavar="FILE", help="write every figure as JSON")

    gpu = benches.add_parser(
        "gpu", help="the GPT recipe on one GPU worker vs a plain PyTorch loop: samples/s, tokens/s, MFU, peak memory"
    )
    gpu.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run of the bench (with --tiny)")
    gpu.add_argument("--tiny", action="store_true", help="a tiny GPT instead of the largest that fits (smoke runs)")
    gpu.add_argument("--steps", type=int, default=40, help="steps per run, warm-up included")
    gpu.add_argument("--warmup", type=int, default=10, help="steps before the timed span")
    gpu.add_argument("--rounds", type=int, default=2, help="alternating ringleader/plain rounds (medians)")
    gpu.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, where its name is not in the table")
    gpu.add_argument("--compile", action="store_true", help="both contenders' model compiled (model.compile: true)")
    gpu.add_argument("--json", dest="json_path", metavar="FILE", help="write the medians as JSON")

    overhead = benches.add_parser(
        "overhead", help="ringleader's host cost a step vs a plain PyTorch loop (the 710M GPT's tensor layout, scaled "
        "down) and syncs a step: a CPU proxy for the GPU's step"
    )
    overhead.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    overhead.add_argument("--steps", type=int, default=20, help="steps per round and contender")
    overhead.add_argument("--warmup", type=int, default=3, help="untimed steps of each contender first")
    overhead.add_argument("--rounds", type=int, default=9, help="alternating plain/ringleader rounds (medians)")
    overhead.add_argument("--json", dest="json_path", metavar="FILE", help="write the figures as JSON")

    data = benches.add_parser(
        "data", help="input from token files and a Ray Data pipeline: reader samples/s vs plain readers, "
        "jobs' data wait, resume at 10^6 samples"
    )
    data.add_argument("--tokens", type=int, default=1 << 24, help="random tokens written (default 16M)")
    data.add_argument("--shard-tokens", type=int, default=1 << 21, help="tokens per file (default 2M)")
    data.add_argument("--seq-len", type=int, default=1024, help="tokens per sample in the reader figures")
    data.add_argument("--samples", type=int, default=20000, help="samples each reader reads per round")
    data.add_argument("--rounds", type=int, default=5, help="alternating reader rounds (medians)")
    data.add_argument("--workers", type=int, default=2, help="workers of the GPT job")
    data.add_argument("--steps", type=int, default=40, help="steps of the GPT jobs")
    data.add_argument("--stream-rows", type=int, default=20000, help="rows of the Ray Data pipeline read (default 20000)")
    data.add_argument("--json", dest="json_path", metavar="FILE", help="write the figures as JSON")


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.bench`` asks for; its exit code."""
    if args.bench == "throughput":
        from benchmarks import throughput

        workloads = args.workload or ["digits", "tinylm"]
        return throughput.main(workloads, args.workers, args.steps, args.repeats, args.json_path)
    if args.bench == "control-plane":
        from benchmarks import control_plane

        return control_plane.main(
            args.workers, args.steps, args.json_path, synthetic=args.synthetic or [], claim_stores=args.claim_stores
        )
    if args.bench == "allreduce":
        from benchmarks import collectives

        return collectives.main_allreduce(args.workers, args.sizes, args.nodes, args.iters, args.json_path)
    if args.bench == "overlap":
        from benchmarks import collectives

        return collectives.main_overlap(args.workload, args.workers, args.rounds, args.steps, args.json_path)
    if args.bench == "straggler":
        from benchmarks import straggler

        chaos = straggler.StragglerChaos(
            args.kind, args.factor, args.probability, args.stall_steps, args.during, args.seed
        )
        return straggler.main(args.workload, args.workers, args.steps, chaos, args.repeats, args.json_path)
    if args.bench == "recovery":
        from benchmarks import recovery

        return recovery.main(
            args.workload, args.workers, args.steps, args.kill_step, args.checkpoint_every, args.repeats,
            args.overhead_steps, args.json_path, args.exact_steps, args.exact_kill_step,
        )
    if args.bench == "sharding":
        from benchmarks import sharding

        return sharding.main(args.workloads, args.group_sizes, args.workers, args.steps, args.repeats, args.json_path)
    if args.bench == "gpu":
        from benchmarks import gpu

        return gpu.main(
            args.device, args.tiny, args.steps, args.warmup, args.rounds, args.peak_tflops, args.json_path, args.compile
        )
    if args.bench == "overhead":
        from benchmarks import overhead

        return overhead.main(args.device, args.steps, args.warmup, args.rounds, args.json_path)
    if args.bench == "data":
        from benchmarks import data

        return data.main(
            args.tokens, args.shard_tokens, args.seq_len, args.samples, args.rounds, args.workers, args.steps,
            args.stream_rows, args.json_path,
        )
    raise AssertionError(f"unhandled bench {args.bench}")
