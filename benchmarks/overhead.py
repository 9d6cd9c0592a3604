"""``ringleader bench overhead``: ringleader's host cost a step, against a plain PyTorch loop,
on the CPU: a proxy for what separates the two on a GPU, measurable without one.

On a GPU a step's kernels are the same in both contenders (``bench gpu``'s profile); what
differs is the host's work around them (hooks, hand-offs, bookkeeping, reports) and its syncs,
after each of which the GPU idles until the host has queued more. Here both contenders run one
model with the layout of the GPT the GPU bench trains (gpt2-large: 36 layers, the same 436
parameter tensors in the same arrangement), every width divided by ``SCALE`` so that compute
is small beside the host's work: the difference of their step times is ringleader's host
overhead a step. Syncs a step are counted over one more step of each (``HostSyncs``).

Both run in this process, without Ray: the plain loop (``PlainLoop``), and one ``TrainWorker``
in a process group of one, stepped with the plan the driver makes by default (mitigations
on). Rounds alternate (plain, ringleader, ...); each round times ``steps`` steps of each, and
the overhead is the median of the rounds' differences, with their spread.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.host_syncs import HostSyncs
from benchmarks.plain_loop import PlainLoop, sync

#: gpt2-large's layout (``benchmarks/gpu.py``'s largest) with every width divided by this.
SCALE = 64
LAYERS, HEADS, WIDTH, BLOCK, BATCH = 36, 20, 1280 // SCALE, 8, 4
#: The target for ringleader's host overhead a step at this tensor count (issue 42).
TARGET_MS = 2.0


def overhead_job(device: str, steps: int) -> Any:
    """The GPT recipe (examples/gpt.yaml) at the scaled layout, one worker on ``device``."""
    from benchmarks.workloads import EXAMPLES
    from orchestrator.job.reading import load_job

    model = {"vocab_size": 256, "block_size": BLOCK, "n_layer": LAYERS, "n_head": HEADS, "n_embd": WIDTH}
    resources = "{CPU: 1, GPU: 1}" if device == "cuda" else "{CPU: 1}"
    # On the CPU in fp32: its bf16 matrix products are slow, and compute is not what is measured.
    precision = "bf16" if device == "cuda" else "fp32"
    return load_job(EXAMPLES / "gpt.yaml", [f"precision={precision}",
        f"model.kwargs={json.dumps(model)}", f"dataset.kwargs={{split: train, block_size: {BLOCK}}}", "eval=null",
        f"batch_size={BATCH}", "shards=4", f"steps={steps}", "checkpoint.every_steps=0", "collective.algorithm=native",
        f"scaling={{workers: 1, min_workers: 1, max_workers: 1, resources_per_worker: {resources}}}",
    ])


@contextmanager
def solo_worker(job: Any, device: torch.device) -> Iterator[tuple[Any, Any]]:
    """A ``TrainWorker`` for ``job`` on ``device`` in a process group of one (a TCPStore of its
    own, no Ray), and the ``StepPlan`` the driver makes by default for one worker (mitigations
    on): ``worker.train_step(index, plan)`` trains step ``index``, the next one."""
    from torch.distributed import TCPStore

    from jobspec.wire import JoinRequest
    from policies.work_stealing import StepPlan
    from workers.actor import TrainWorker

    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    worker = TrainWorker(job, device=device)
    worker.join_group(JoinRequest("127.0.0.1", store.port, "solo/", 1, 0, ("node",), job.timeouts.collective_s))
    plan = StepPlan((tuple(range(job.shards)),))
    try:
        yield worker, plan
    finally:
        worker.leave_group()


def timed_ms(step: Callable[[int], None], first: int, steps: int, device: torch.device) -> float:
    """Milliseconds a step over steps ``first`` .. ``first + steps - 1`` (the device synced
    at both ends only)."""
    sync(device)
    started = time.perf_counter()
    for index in range(first, first + steps):
        step(index)
    sync(device)
    return (time.perf_counter() - started) * 1e3 / steps


def counted_syncs(step: Callable[[int], None], index: int) -> HostSyncs:
    """The host syncs of step ``index``."""
    with HostSyncs() as syncs:
        step(index)
    return syncs


def measure(device: torch.device, steps: int, warmup: int, rounds: int) -> dict[str, Any]:
    """Both contenders: ms a step per round, syncs a step (with their sites) and the overhead."""
    job = overhead_job(device.type, warmup + rounds * steps + 1)
    plain = PlainLoop(job, device)
    num_params = sum(p.numel() for p in plain.model.parameters())
    tensors = len(list(plain.model.parameters()))
    rows: dict[str, list[float]] = {"plain": [], "ringleader": []}
    with solo_worker(job, device) as (worker, plan):
        contenders = {"plain": plain.step, "ringleader": lambda index: worker.train_step(index, plan)}
        for step in contenders.values():
            timed_ms(step, 0, warmup, device)
        for index in range(rounds):
            for name, step in contenders.items():
                rows[name].append(timed_ms(step, warmup + index * steps, steps, device))
        last = warmup + rounds * steps
        syncs = {name: counted_syncs(step, last) for name, step in contenders.items()}
    differences = [r - p for r, p in zip(rows["ringleader"], rows["plain"])]
    return {
        "device": str(device), "layers": LAYERS, "width": WIDTH, "block": BLOCK, "batch": BATCH,
        "tensors": tensors, "num_params": num_params, "steps": steps, "rounds": rounds,
        "ms_per_step": {name: statistics.median(values) for name, values in rows.items()},
        "rounds_ms": rows,
        "syncs_per_step": {name: s.count for name, s in syncs.items()},
        "sync_sites": {name: dict(s.sites) for name, s in syncs.items()},
        "overhead_ms": statistics.median(differences),
        "overhead_spread_ms": [min(differences), max(differences)],
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [f"{'contender':10s} {'ms/step':>9s} {'syncs/step':>11s}"]
    for name in ("plain", "ringleader"):
        lines.append(f"{name:10s} {result['ms_per_step'][name]:9.2f} {result['syncs_per_step'][name]:11d}")
    for site, count in result["sync_sites"]["ringleader"].items():
        lines.append(f"  sync: {count} x {site}")
    low, high = result["overhead_spread_ms"]
    verdict = "met" if result["overhead_ms"] <= TARGET_MS else "NOT met"
    lines.append(
        f"ringleader's host overhead {result['overhead_ms']:.2f} ms a step (median of {result['rounds']} paired rounds, "
        f"spread {low:.2f} to {high:.2f}; target <= {TARGET_MS} ms: {verdict}), "
        f"{result['syncs_per_step']['ringleader']} sync(s) a step (target <= 1)"
    )
    return "\n".join(lines)


def main(device_name: str, steps: int, warmup: int, rounds: int, json_path: str | None) -> int:
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("ringleader: bench overhead: no CUDA device (torch.cuda.is_available() is False)")
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1)  # compute is not what is measured; its threads would crowd the worker's
    result = measure(device, steps, warmup, rounds)
    print(f"bench overhead: {device}; GPT with gpt2-large's layout ({result['tensors']} tensors, {LAYERS} layers) at "
          f"width {WIDTH} ({result['num_params'] / 1e6:.1f}M parameters), block {BLOCK}, batch {BATCH}, "
          f"{rounds} rounds of {steps} steps each")
    print(format_result(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")
    return 0
