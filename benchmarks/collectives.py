"""Collective benchmarks in plain processes (gloo, no Ray): all-reduce bandwidth, and overlap.

``allreduce``: for each size, native ``all_reduce`` and our ring (and hierarchical, with
simulated nodes) take turns, so drift hits all alike. Bandwidths as in nccl-tests: algbw =
bytes / time, busbw = algbw * 2(n-1)/n, the per-link load a ring must carry.

``overlap``: real worker steps (the actor's own ``train_step``, without Ray around it) with
overlap on and off in alternating rounds; exposed communication is the wait after backward.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from policies.collective_cost import Fabric, Link, allreduce_s, fit_link
from workers.comm.comm_group import CommGroup
from workers.comm.communicator import make_communicator
from workers.comm.process_group import new_process_group

MB = 1 << 20
DEFAULT_SIZES_MB = (1, 4, 16, 64)


def _group(rank: int, world: int, port: int) -> CommGroup:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    pg = new_process_group("gloo", dist.PrefixStore("bench/", store), rank, world, 300.0)
    return CommGroup(pg, rank, world, 300.0, threading.Event())


def _allreduce_rank(
    rank: int, world: int, port: int, results: dict, sizes: list[int], algorithms: list[str], nodes: list[str], iters: int
) -> None:
    torch.set_num_threads(1)
    group = _group(rank, world, port)
    communicators = {name: make_communicator(name, group, nodes) for name in algorithms}
    barrier = make_communicator("native", group, nodes)
    token = torch.zeros(1)
    for size in sizes:
        tensor = torch.ones(size // 4)
        times: dict[str, list[float]] = {name: [] for name in algorithms}
        for iteration in range(iters + 1):  # the first round warms up connections and buffers
            for name, communicator in communicators.items():
                barrier.start_sum(token).wait()
                started = time.perf_counter()
                communicator.start_sum(tensor).wait()
                if iteration:
                    times[name].append(time.perf_counter() - started)
        if rank == 0:
            for name in algorithms:
                results[(name, size)] = statistics.median(times[name])
    group.close()


def _spawn(target: Any, world: int, *args: Any) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    with mp.get_context("spawn").Manager() as manager:  # not forked: the caller may hold a running Ray
        results = manager.dict()
        mp.spawn(target, args=(world, store.port, results, *args), nprocs=world, join=True)
        return dict(results)


def allreduce_rows(workers: int, sizes_mb: list[float], nodes: int, iters: int) -> list[dict[str, Any]]:
    """Median seconds and bandwidths per (algorithm, size); ``nodes`` > 1 simulates that many
    nodes (ranks dealt round-robin) and adds the hierarchical algorithm."""
    node_ids = [f"node{rank % nodes}" for rank in range(workers)]
    algorithms = ["native", "ring"] + (["hierarchical"] if 1 < nodes < workers else [])
    sizes = [int(mb * MB) // 4 * 4 for mb in sizes_mb]
    times = _spawn(_allreduce_rank, workers, sizes, algorithms, node_ids, iters)
    rows = []
    for size in sizes:
        for name in algorithms:
            seconds = times[(name, size)]
            algbw = size / seconds / 1e9
            rows.append({
                "algorithm": name, "workers": workers, "nodes": nodes, "size_bytes": size, "time_s": seconds,
                "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (workers - 1) / workers,
            })
    return rows


def format_allreduce(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'size':>9s} {'algorithm':12s} {'workers':>7s} {'time_ms':>9s} {'algbw GB/s':>10s} {'busbw GB/s':>10s} {'vs native':>9s}"]
    native = {(r["size_bytes"], r["workers"]): r for r in rows if r["algorithm"] == "native"}
    for r in rows:
        base = native[(r["size_bytes"], r["workers"])]
        lines.append(
            f"{r['size_bytes'] / MB:7.1f}MB {r['algorithm']:12s} {r['workers']:7d} {r['time_s'] * 1e3:9.2f} "
            f"{r['algbw_gbps']:10.3f} {r['busbw_gbps']:10.3f} {r['busbw_gbps'] / base['busbw_gbps']:8.2f}x"
        )
    return "\n".join(lines)


def _overlap_rank(
    rank: int, world: int, port: int, results: dict, job_json: str, rounds: int, steps: int
) -> None:
    from jobspec.job import JobConfig
    from jobspec.wire import JoinRequest
    from policies.assignment import ShardAssignment
    from policies.work_stealing import StepPlan
    from workers.actor import TrainWorker

    torch.set_num_threads(1)
    job = JobConfig.model_validate_json(job_json)
    # Fixed shards, no mitigation: this measures the collectives, not the straggler machinery.
    plan = StepPlan(ShardAssignment.balanced(job.shards, world).shards_by_rank, steal=False, speculate=False)
    workers = {}
    for overlap in (True, False):
        variant = job.model_copy(update={"collective": job.collective.model_copy(update={"overlap": overlap})})
        workers[overlap] = TrainWorker(variant)
    generation = 0
    for round_ in range(rounds):
        for overlap, worker in workers.items():
            generation += 1
            worker.join_group(JoinRequest("127.0.0.1", port, f"gen{generation}/", generation, rank, ("node",) * world, 60.0))
            reports = [worker.train_step(worker.next_step, plan) for _ in range(steps)]
            worker.leave_group()
            if rank == 0:
                kept = reports[2:]  # skip warm-up steps of each group
                results[(overlap, round_)] = (
                    statistics.median(r.step_s for r in kept),
                    statistics.median(r.comm_s for r in kept),
                )
        if rank == 0:
            # Both modes trained the same steps from the same start: overlap must change when
            # the buckets are reduced, never what the step computes.
            with_, without = (torch.nn.utils.parameters_to_vector(workers[o].model.parameters()) for o in (True, False))
            results[("param_diff", round_)] = float((with_ - without).abs().max())


def overlap_result(job_json: str, workers: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """``{"overlap": {"step_s", "exposed_comm_s"}, "no_overlap": {...}}``, medians over rounds,
    and ``"agreement": {"max_param_diff"}``: the largest difference between the two modes'
    parameters after any round (they train the same steps from the same start)."""
    results = _spawn(_overlap_rank, workers, job_json, rounds, steps)
    out = {"agreement": {"max_param_diff": max(results[("param_diff", r)] for r in range(rounds))}}
    for overlap, key in ((True, "overlap"), (False, "no_overlap")):
        mine = [results[(overlap, r)] for r in range(rounds)]
        out[key] = {
            "step_s": statistics.median(m[0] for m in mine),
            "exposed_comm_s": statistics.median(m[1] for m in mine),
        }
    return out


def cost_model(rows: list[dict[str, Any]], cores: int) -> tuple[dict[str, Link], list[dict[str, Any]]]:
    """The alpha-beta model (``policies/collective_cost.py``) calibrated on ``rows`` of one
    machine with ``cores`` cores: one link for gloo's native ring, one for ours (the ring's
    hop, which the hierarchical algorithm is built from), each fitted on its ring's rows; and
    every row's prediction and error. Simulated nodes share the machine's cores, so each gets
    ``cores / nodes`` of them."""
    def points(algorithm: str) -> list[tuple[int, float, float]]:
        return [(r["workers"], r["size_bytes"], r["time_s"]) for r in rows if r["algorithm"] == algorithm]

    links = {"native": fit_link(points("native"), cores), "ours": fit_link(points("ring"), cores)}
    predicted = []
    for r in rows:
        link = links["native" if r["algorithm"] == "native" else "ours"]
        fabric = Fabric(link, link, cores_per_node=cores / r["nodes"])
        seconds = allreduce_s(r["algorithm"], r["size_bytes"], r["workers"], r["nodes"], fabric)
        predicted.append({**r, "predicted_s": seconds, "error": seconds / r["time_s"] - 1})
    return links, predicted


def format_cost_model(links: dict[str, Link], predicted: list[dict[str, Any]], tolerance: float = 0.25) -> str:
    lines = ["alpha-beta model (policies/collective_cost.py) calibrated on these rows:"]
    lines += [f"  {name}: alpha {link.alpha_s * 1e6:.0f} us per hop, beta {link.beta_bytes_s / 1e9:.2f} GB/s" for name, link in links.items()]
    for r in predicted:
        lines.append(
            f"  {r['size_bytes'] / MB:7.1f}MB {r['algorithm']:12s} n={r['workers']} nodes={r['nodes']}: measured "
            f"{r['time_s'] * 1e3:8.2f} ms, predicted {r['predicted_s'] * 1e3:8.2f} ms ({r['error']:+.0%})"
        )
    within = sum(abs(r["error"]) <= tolerance for r in predicted)
    worst = max(abs(r["error"]) for r in predicted)
    lines.append(f"  within {tolerance:.0%}: {within} of {len(predicted)}; worst {worst:.0%}")
    return "\n".join(lines)


def main_allreduce(workers: list[int], sizes_mb: list[float], nodes: int, iters: int, json_path: str | None) -> int:
    rows = []
    for count in workers:
        print(f"allreduce: {count} workers, sizes {sizes_mb} MB, {iters} timed rounds, gloo")
        rows += allreduce_rows(count, sizes_mb, nodes, iters)
    print(format_allreduce(rows))
    report: dict[str, Any] = {"rows": rows}
    if len({(r["workers"], r["size_bytes"]) for r in rows}) > 1:
        cores = len(os.sched_getaffinity(0))
        links, predicted = cost_model(rows, cores)
        print(format_cost_model(links, predicted))
        report["cost_model"] = {
            "cores": cores, "links": {n: {"alpha_s": l.alpha_s, "beta_bytes_s": l.beta_bytes_s} for n, l in links.items()},
            "rows": predicted,
        }
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}")
    return 0


def main_overlap(workload: str, workers: int, rounds: int, steps: int, json_path: str | None) -> int:
    from benchmarks.workloads import workload_job

    job = workload_job(workload, workers, steps * rounds * 2)
    print(f"overlap: {workload}, {workers} workers, {rounds} rounds x {steps} steps each way, {job.collective.algorithm}")
    result = overlap_result(job.model_dump_json(), workers, rounds, steps)
    on, off = result["overlap"], result["no_overlap"]
    print(f"{'':12s} {'step_ms':>9s} {'exposed_comm_ms':>16s}")
    for name, values in (("overlap", on), ("no_overlap", off)):
        print(f"{name:12s} {values['step_s'] * 1e3:9.2f} {values['exposed_comm_s'] * 1e3:16.2f}")
    print(
        f"exposed comm overlap/no_overlap {on['exposed_comm_s'] / off['exposed_comm_s']:.2f}x, "
        f"step time {on['step_s'] / off['step_s']:.2f}x, "
        f"parameters differ by at most {result['agreement']['max_param_diff']:.2g}"
    )
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")
    return 0
