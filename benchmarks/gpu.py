"""``ringleader bench gpu``: the GPT recipe (examples/gpt.yaml: AdamW, clipping, bf16 autocast,
the next-token loss) on one worker on the GPU present, against a plain single-GPU PyTorch loop
of the same model, batch, optimizer and precision, measured in the same run.

Rounds alternate (ringleader, plain, ringleader, plain, ...) so drift hits both alike; medians
are reported. For each: samples/s, tokens/s (windows x block_size per step, over the steps
after the warm-up), MFU and peak memory. ``ratio`` is ringleader's tokens/s over the plain
loop's: ringleader's per-step overhead on a GPU, the target being >= 0.97.

MFU: model FLOPs per token ``6 N + 12 L d T`` (N parameters, L layers, d width, T block size:
6 N for the forward and backward matrix products, 12 L d T for attention's scores and
weighted sums; PaLM's appendix B, as nanoGPT counts it; the causal mask not halved), times
tokens/s, over the device's peak dense bf16 FLOP/s, looked up by device name (``PEAK_BF16``;
``--peak-tflops`` for a device not listed). Peak memory is ``torch.cuda.max_memory_allocated``:
in the plain loop's process, and in ringleader's worker, read after training by an eval metric
(``peak_memory``), the only code of ours that runs there after the last step.

``--device cpu --tiny`` runs the same code on the CPU with a tiny model in seconds (CI runs
it, so the bench cannot rot); figures from it mean nothing.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.plain_loop import PlainLoop, sync

#: Dense bf16 tensor-core peak FLOP/s by device-name fragment (a whole model name: "L4" is not
#: "L40"), first match wins (NVIDIA's data
#: sheets; SXM figures unless the name says otherwise).
PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),  # GH200 too
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
)
#: The ratio to the plain loop the bench is held to (ringleader's per-step overhead <= 3%).
TARGET_RATIO = 0.97
# Step completions this close together were committed in one run-ahead batch (the driver
# commits a batch's steps within a millisecond): not a boundary a span can be timed from.
BURST_S = 0.002
GIB = 2**30


@dataclass(frozen=True)
class GptSize:
    """A GPT layout of examples/gpt.yaml's model (byte vocabulary) and the batch it trains on."""

    name: str
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch: int

    def model_kwargs(self) -> dict[str, int]:
        return {"vocab_size": 256, "block_size": self.block_size, "n_layer": self.n_layer, "n_head": self.n_head,
                "n_embd": self.n_embd}


TINY = GptSize("tiny", 2, 2, 64, 64, 8)
# GPT-2's layouts (with a byte vocabulary, so ~10% fewer parameters), largest first, and the
# device memory each needs to train comfortably at its batch (16 x 1024 tokens) in bf16.
SIZES: tuple[tuple[GptSize, int], ...] = (
    (GptSize("gpt2-large", 36, 20, 1280, 1024, 16), 64 * GIB),  # ~710M parameters, ~45 GiB peak
    (GptSize("gpt2-medium", 24, 16, 1024, 1024, 16), 32 * GIB),  # ~300M
    (GptSize("gpt2", 12, 12, 768, 1024, 16), 12 * GIB),  # ~85M
)


@dataclass(frozen=True)
class Measured:
    """One round of one contender."""

    contender: str
    samples_per_s: float
    tokens_per_s: float
    peak_memory_gib: float


def choose_size(device_bytes: int) -> GptSize:
    """The largest layout that trains comfortably in ``device_bytes`` of device memory."""
    for size, needs in SIZES:
        if device_bytes >= needs:
            return size
    return SIZES[-1][0]


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the device called ``device_name`` (torch's name for it), or None."""
    return next((peak for fragment, peak in PEAK_BF16 if re.search(rf"{re.escape(fragment)}(?![0-9A-Za-z])", device_name)), None)


def flops_per_token(num_params: int, size: GptSize) -> float:
    """Training FLOPs per token: ``6 N + 12 L d T`` (see the module doc)."""
    return 6.0 * num_params + 12.0 * size.n_layer * size.n_embd * size.block_size


def steady_span(ends: list[float], warmup: int) -> tuple[int, float]:
    """From step completion times ``ends``: how many steps completed in the timed span and its
    seconds. The span starts at the first completion, from step ``warmup - 1`` on, that ends a
    run-ahead batch (the next step completes more than ``BURST_S`` later), so no step of the
    span was computed before it; it ends at the last completion."""
    if len(ends) < warmup + 2:
        raise ValueError(f"need at least {warmup + 2} steps to time after {warmup} of warm-up, got {len(ends)}")
    start = max(warmup - 1, 0)
    while start < len(ends) - 2 and ends[start + 1] - ends[start] <= BURST_S:
        start += 1
    return len(ends) - 1 - start, ends[-1] - ends[start]


def peak_memory(model: torch.nn.Module, batch: Any) -> dict[str, float]:
    """An eval metric (``eval.metrics``) run in ringleader's worker: the device's peak allocated
    bytes so far (training's, eval allocates less). Eval averages metrics over samples, so each
    batch reports it times its size."""
    device = next(model.parameters()).device
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"peak_memory_bytes": float(peak) * len(batch)}


def _job(size: GptSize, device: str, steps: int, compile_model: bool = False) -> Any:
    from benchmarks.workloads import EXAMPLES
    from orchestrator.job.reading import load_job

    resources = "{CPU: 1, GPU: 1}" if device == "cuda" else "{CPU: 1}"
    data = f"{{split: val, block_size: {size.block_size}}}"
    return load_job(EXAMPLES / "gpt.yaml", [
        f"model.kwargs={json.dumps(size.model_kwargs())}",
        f"dataset.kwargs={{split: train, block_size: {size.block_size}}}",
        # One eval batch: all it is there for is the peak memory.
        f"eval={{factory: 'ringleader_examples.gpt:make_dataset', kwargs: {data}, batch_size: {size.batch}, "
        "metrics: 'benchmarks.gpu:peak_memory'}",
        f"batch_size={size.batch}", "shards=4", f"steps={steps}", "checkpoint.every_steps=0",
        f"scaling={{workers: 1, min_workers: 1, max_workers: 1, resources_per_worker: {resources}}}",
        "collective.algorithm=native",  # one worker: nothing to probe
        f"model.compile={str(compile_model).lower()}",
    ])


def run_ringleader(job: Any, workdir: Path, warmup: int) -> Measured:
    """``job`` through ringleader (``run_job``: this process's Ray, or a local one it starts)."""
    from orchestrator.launch import run_job

    result = run_job(job, run_dir=workdir)
    if result.summary["status"] != "finished":
        raise RuntimeError(f"ringleader's run failed: {result.summary.get('error')}")
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    ends = [e["time"] for e in events if e["event"] == "step"]
    steps, seconds = steady_span(ends, warmup)
    block = job.model.kwargs["block_size"]
    peak = result.summary["eval"].get("peak_memory_bytes", 0.0)
    return Measured("ringleader", steps * job.batch_size / seconds, steps * job.batch_size * block / seconds, peak / GIB)


def run_plain(job: Any, device: torch.device, warmup: int) -> Measured:
    """The recipe as a plain single-device loop: the same model, windows, AdamW (fused, the
    same decay groups), clipping and autocast; timed from the end of the warm-up to the end of
    the last step (one device sync at each end: none per step)."""
    seconds, peak = _plain_loop(job, device, warmup)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the loop's memory, freed on return, goes back for ringleader's worker
    steps, block = job.steps - warmup, job.model.kwargs["block_size"]
    return Measured("plain", steps * job.batch_size / seconds, steps * job.batch_size * block / seconds, peak)


def _plain_loop(job: Any, device: torch.device, warmup: int) -> tuple[float, float]:
    """``run_plain``'s loop: the timed seconds and the peak GiB allocated on ``device``."""
    loop = PlainLoop(job, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for index in range(warmup):
        loop.step(index)
    sync(device)
    started = time.perf_counter()
    for index in range(warmup, job.steps):
        loop.step(index)
    sync(device)
    seconds = time.perf_counter() - started
    return seconds, torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0


def summarize(rows: list[Measured], num_params: int, size: GptSize, peak: float | None) -> dict[str, Any]:
    """Medians per contender, MFU where the peak is known, and ringleader's ratio to the plain loop."""
    table: dict[str, Any] = {}
    for contender in ("ringleader", "plain"):
        mine = [r for r in rows if r.contender == contender]
        tokens = statistics.median(r.tokens_per_s for r in mine)
        table[contender] = {
            "samples_per_s": statistics.median(r.samples_per_s for r in mine),
            "tokens_per_s": tokens,
            "mfu": tokens * flops_per_token(num_params, size) / peak if peak else None,
            "peak_memory_gib": max(r.peak_memory_gib for r in mine),
        }
    table["ratio"] = table["ringleader"]["tokens_per_s"] / table["plain"]["tokens_per_s"]
    return table


def format_table(table: dict[str, Any]) -> str:
    lines = [f"{'contender':10s} {'samples/s':>10s} {'tokens/s':>12s} {'MFU':>7s} {'peak GiB':>9s}"]
    for contender in ("ringleader", "plain"):
        m = table[contender]
        mfu = f"{m['mfu'] * 100:6.1f}%" if m["mfu"] is not None else "    n/a"
        lines.append(f"{contender:10s} {m['samples_per_s']:10.1f} {m['tokens_per_s']:12.0f} {mfu} {m['peak_memory_gib']:9.2f}")
    verdict = "met" if table["ratio"] >= TARGET_RATIO else "NOT met"
    lines.append(f"ratio ringleader/plain tokens/s {table['ratio']:.3f}x (target >= {TARGET_RATIO}x: {verdict})")
    return "\n".join(lines)


def main(
    device_name: str,
    tiny: bool,
    steps: int,
    warmup: int,
    rounds: int,
    peak_tflops: float | None,
    json_path: str | None,
    compile_model: bool = False,
) -> int:
    if device_name == "cuda" and not torch.cuda.is_available():
        print("ringleader: bench gpu: no CUDA device (torch.cuda.is_available() is False); "
              "--device cpu --tiny runs a smoke test of the bench on the CPU", file=sys.stderr)
        return 2
    device = torch.device(device_name)
    if tiny:
        size = TINY
    else:
        size = choose_size(torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops * 1e12 if peak_tflops else (peak_flops(name) if device.type == "cuda" else None)
    job = _job(size, device_name, steps, compile_model)
    from ringleader_examples.gpt import make_model

    num_params = sum(p.numel() for p in make_model(**job.model.kwargs).parameters())
    print(f"bench gpu: {name}; peak bf16 {f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown (--peak-tflops)'}; "
          f"GPT {size.name} ({num_params / 1e6:.0f}M parameters, {size.n_layer} layers, width {size.n_embd}, "
          f"block {size.block_size}), batch {size.batch}, bf16, {'compiled' if compile_model else 'eager'}, "
          f"{steps} steps ({warmup} warm-up), {rounds} rounds; "
          f"FLOPs/token 6N + 12*L*d*T = {flops_per_token(num_params, size):.3e}")
    rows: list[Measured] = []
    with tempfile.TemporaryDirectory(prefix="rl-bench-gpu-") as scratch:
        for index in range(rounds):
            for row in (run_ringleader(job, Path(scratch) / f"run-{index}", warmup), run_plain(job, device, warmup)):
                print(f"  [{index + 1}/{rounds}] {row.contender:10s} {row.tokens_per_s:12.0f} tokens/s "
                      f"{row.samples_per_s:9.1f} samples/s  peak {row.peak_memory_gib:.2f} GiB")
                rows.append(row)
    table = summarize(rows, num_params, size, peak)
    print(format_table(table))
    if json_path:
        payload = {
            **table, "device": name, "peak_flops": peak, "size": asdict(size), "num_params": num_params,
            "compile": compile_model,
        }
        Path(json_path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {json_path}")
    return 0
