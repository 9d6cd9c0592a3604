"""``ringleader bench data``: input from a directory of token files, all figures from one run.

* **Reader**: samples/s of one process reading steps the way 2 workers do (each its block of
  shards: the per-index shuffle, the windows gathered from the files' memory maps, batched by
  the default collate), against a plain sequential reader (``np.memmap`` windows in file order, stacked):
  alternating rounds, medians.
* **Data wait**: the GPT recipe trained from the directory and from the Ray Data example
  (``ringleader_examples/text_stream.py``), and the tinylm recipe (``ringleader run``, fresh
  processes): the share of each worker's step time spent waiting for its data
  (``stalled_s``), steps 3 on.
* **Ray Data**: ``benchmarks/data_stream.py``'s figures.
* **Resume at 10^6 samples**: what a resumed run pays for its data before its first step: the
  index re-checked (a stat a file) and the first shard's indices at the step after 10^6
  samples, against the same at step 0 (the sampler is a pure function of the step: O(1)).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.throughput import read_run, run_ringleader
from benchmarks.workloads import workload_job
from jobspec.data_index import DataIndex
from jobspec.recipe import DatasetSpec
from jobspec.step_record import read_telemetry
from orchestrator.data.index import build_index, checked_index
from workers.data.batches import fetch_batch
from workers.data.files import IndexedFiles
from workers.data.sampler import ShardSampler

RESUME_SAMPLES = 10**6


def write_token_dir(directory: Path, tokens: int, shard_tokens: int, seed: int = 0) -> list[Path]:
    """``tokens`` random uint16 token ids (vocabulary 256) as files of ``shard_tokens`` each."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for number, start in enumerate(range(0, tokens, shard_tokens)):
        path = directory / f"tokens-{number:05d}.bin"
        rng.integers(0, 256, min(shard_tokens, tokens - start), dtype=np.uint16).astype("<u2").tofile(path)
        paths.append(path)
    return paths


def plain_reader_rate(paths: list[Path], seq_len: int, batch: int, samples: int) -> float:
    """Samples/s of sequential ``np.memmap`` windows, ``batch`` stacked at a time."""
    started, read = time.perf_counter(), 0
    maps = [np.memmap(p, dtype="<u2", mode="r") for p in paths]
    while read < samples:
        for tokens in maps:
            for lo in range(0, len(tokens) - seq_len + 1, seq_len * batch):
                rows = [torch.from_numpy(tokens[at : at + seq_len].astype(np.int64))
                        for at in range(lo, min(lo + seq_len * batch, len(tokens) - seq_len + 1), seq_len)]
                torch.stack(rows)
                read += len(rows)
                if read >= samples:
                    return read / (time.perf_counter() - started)
    return read / (time.perf_counter() - started)


def ringleader_reader_rate(data: IndexedFiles, batch: int, shards: int, samples: int, workers: int = 2) -> float:
    """Samples/s of reading whole steps as ``workers`` workers do, each its block of shards in one
    fused pass (``ShardSampler.indices``, ``fetch_batch``)."""
    sampler = ShardSampler(len(data), batch, shards, seed=0)
    blocks = [list(block) for block in np.array_split(np.arange(shards), workers)]
    started, read, step = time.perf_counter(), 0, 0
    while read < samples:
        for block in blocks:
            indices = sampler.indices(step, block)
            fetch_batch(data, indices, None)
            read += len(indices)
        step += 1
    return read / (time.perf_counter() - started)


def token_index(directory: Path, seq_len: int) -> DataIndex:
    """The index a job reading ``directory``'s token files in samples of ``seq_len`` builds."""
    return build_index(DatasetSpec(files=str(directory / "*.bin"), format="tokens", seq_len=seq_len), "dataset", 300)


def reader_figures(index: DataIndex, batch: int, shards: int, samples: int, rounds: int) -> dict[str, Any]:
    paths, seq_len = [Path(entry.uri) for entry in index.files], index.spec["seq_len"]
    data = IndexedFiles(index)
    plain, ours = [], []
    for _ in range(rounds):
        plain.append(plain_reader_rate(paths, seq_len, batch, samples))
        ours.append(ringleader_reader_rate(data, batch, shards, samples))
    return {
        "samples": len(data), "files": len(paths), "seq_len": seq_len,
        "plain_samples_per_s": statistics.median(plain), "ringleader_samples_per_s": statistics.median(ours),
        "ratio": statistics.median(ours) / statistics.median(plain),
    }


def resume_figures(index: DataIndex, batch: int, shards: int) -> dict[str, Any]:
    started = time.perf_counter()
    checked_index(index, "dataset")
    check_s = time.perf_counter() - started
    sampler = ShardSampler(index.samples, batch, shards, seed=0)
    timed = {}
    for name, step in (("step_0", 0), ("after_1e6_samples", RESUME_SAMPLES // batch)):
        started = time.perf_counter()
        for _ in range(100):
            sampler.shard_indices(step, 0)
        timed[name] = (time.perf_counter() - started) / 100
    return {"index_check_s": check_s, "files": len(index.files), "first_shard_indices_s": timed}


#: The jobs whose data wait is measured: (recipe, what it reads, overrides; ``{directory}``: the
#: token files). Half a CPU a worker from Ray Data: its tasks need one the workers leave free.
DATA_WAIT_JOBS = {
    "gpt_files": ("gpt", "token files", ("dataset={{files: '{directory}/*.bin', format: tokens, seq_len: 128}}",)),
    "gpt_ray_data": ("gpt", "the Ray Data example", (
        "dataset={{ray_data: ringleader_examples.text_stream:make_dataset, column: tokens}}",
        "scaling.resources_per_worker={{CPU: 0.5}}",
    )),
    "tinylm": ("tinylm", "its in-memory dataset", ()),
}


def data_wait_figures(name: str, directory: Path, workers: int, steps: int, scratch: Path) -> dict[str, Any]:
    """``DATA_WAIT_JOBS[name]`` trained: the share of step time its workers waited for their data."""
    recipe, source, overrides = DATA_WAIT_JOBS[name]
    job = workload_job(recipe, workers, steps, *(item.format(directory=directory) for item in overrides), "eval=null")
    run_dir, wall_s = run_ringleader(job, scratch / name, 900, f"{recipe} from {source}")
    summary, _ = read_run(run_dir)
    telemetry = read_telemetry(run_dir / "telemetry.jsonl")
    warm = [r for r in telemetry if r["step"] >= 3]
    waited, total = sum(r["stalled_s"] for r in warm), sum(r["step_s"] for r in warm)
    return {"recipe": recipe, "source": source, "workers": workers, "steps": steps, "status": summary["status"],
            "wall_s": wall_s, "data_wait_fraction": waited / total if total else float("nan")}


def format_figures(figures: dict[str, Any]) -> str:
    reader, resume = figures["reader"], figures["resume"]
    timed = resume["first_shard_indices_s"]
    waits = [
        f"data wait ({wait['recipe']} from {wait['source']}, {wait['workers']} workers, {wait['steps']} steps, "
        f"{wait['status']}): {100 * wait['data_wait_fraction']:.2f}% of step time"
        for wait in figures["data_wait"].values()
    ]
    return "\n".join([
        f"reader ({reader['samples']} samples of {reader['seq_len']} tokens in {reader['files']} files):",
        f"  plain np.memmap, sequential  {reader['plain_samples_per_s']:>10.0f} samples/s",
        f"  ringleader, shuffled shards  {reader['ringleader_samples_per_s']:>10.0f} samples/s  "
        f"({reader['ratio']:.2f}x plain)",
        *waits,
        f"resume at 10^6 samples: index re-check {1000 * resume['index_check_s']:.1f} ms ({resume['files']} files); "
        f"first shard's indices {1e6 * timed['after_1e6_samples']:.0f} us (at step 0: {1e6 * timed['step_0']:.0f} us)",
    ])


def main(tokens: int, shard_tokens: int, seq_len: int, samples: int, rounds: int, workers: int, steps: int,
         stream_rows: int, json_path: str | None) -> int:
    from benchmarks.data_stream import format_stream_figures, stream_figures

    with tempfile.TemporaryDirectory(prefix="rl-data-bench-") as scratch:
        directory = Path(scratch) / "tokens"
        write_token_dir(directory, tokens, shard_tokens)
        index = token_index(directory, seq_len)
        figures = {
            "reader": reader_figures(index, batch=32, shards=8, samples=samples, rounds=rounds),
            "resume": resume_figures(index, batch=32, shards=8),
            "data_wait": {name: data_wait_figures(name, directory, workers, steps, Path(scratch)) for name in DATA_WAIT_JOBS},
            "stream": stream_figures(stream_rows, seq_len, rounds),
        }
    print(format_figures(figures))
    print(format_stream_figures(figures["stream"]))
    if json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2))
    return 0 if all(wait["status"] == "finished" for wait in figures["data_wait"].values()) else 1
