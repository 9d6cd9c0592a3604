"""``ringleader bench data``'s Ray Data figures, from one local Ray started here:

* **Reader**: samples/s of one process reading steps the way 2 workers do from a feeder actor
  (``StreamRows``: the chunks their shards' rows are in, by reference, samples batched by the
  default collate), against reading the same pipeline with Ray Data's own ``iter_batches``
  (numpy batches made tensors) and ``iter_torch_batches`` (what a Ray Train worker iterates):
  alternating rounds, medians. Each round is a fresh pass of the pipeline for every reader.
* **Bound**: the most bytes of chunks the feeder held, against its bound in chunks.
* **Resume at 10^6 rows**: a fresh feeder's first chunk at row 10^6 (whole blocks before it
  skipped unread, the pipeline still producing them) against its first chunk at row 0.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import ray
import torch

from jobspec.stream import FedStream
from orchestrator.data.feeder import StreamFeeder
from workers.data.batches import fetch_batch
from workers.data.sampler import ShardSampler
from workers.data.stream import StreamRows

RESUME_ROWS = 10**6
TIMEOUT_S = 600.0


def token_rows(batch: dict[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """Each row id made a window of ``seq_len`` token ids (a stand-in for tokenizing)."""
    ids = batch["id"].astype(np.int64)
    return {"tokens": (ids[:, None] * 31 + np.arange(seq_len)) % 256}


def pipeline(rows: int, seq_len: int, blocks: int) -> Any:
    import ray.data

    dataset = ray.data.range(rows, override_num_blocks=blocks)
    dataset = dataset.map_batches(token_rows, fn_kwargs={"seq_len": seq_len}, batch_format="numpy")
    dataset.context.execution_options.preserve_order = True
    return dataset


@contextmanager
def feeder(dataset: Any, chunk_rows: int, held_chunks: int) -> Iterator[Any]:
    actor = ray.remote(StreamFeeder).options(num_cpus=0).remote(dataset, chunk_rows, held_chunks, TIMEOUT_S)
    try:
        yield actor
    finally:
        ray.kill(actor)


def ringleader_rate(rows: StreamRows, batch: int, shards: int, workers: int = 2) -> float:
    """Samples/s of a whole pass read in steps as ``workers`` workers read them."""
    samples = len(rows)
    sampler = ShardSampler(samples, batch, shards, seed=0, shuffle="none")
    blocks = [list(block) for block in np.array_split(np.arange(shards), workers)]
    started, step = time.perf_counter(), 0
    while (step + 1) * batch <= samples:
        for block in blocks:
            fetch_batch(rows, sampler.indices(step, block), None)
        step += 1
    return step * batch / (time.perf_counter() - started)


def iter_batches_rate(dataset: Any, batch: int) -> float:
    started, read = time.perf_counter(), 0
    for columns in dataset.iter_batches(batch_size=batch, batch_format="numpy"):
        read += len(torch.from_numpy(np.array(columns["tokens"])))  # a tensor a step can own, as ours
    return read / (time.perf_counter() - started)


def iter_torch_batches_rate(dataset: Any, batch: int) -> float:
    started, read = time.perf_counter(), 0
    for columns in dataset.iter_torch_batches(batch_size=batch):
        read += len(columns["tokens"])
    return read / (time.perf_counter() - started)


def reader_figures(rows: int, seq_len: int, batch: int, shards: int, rounds: int) -> dict[str, Any]:
    """Alternating rounds, a pass each, after one untimed pass of each reader (Ray Data's
    first pass in a process starts its tasks' workers)."""
    dataset = pipeline(rows, seq_len, blocks=64)
    ours: list[float] = []
    plain: list[float] = []
    torch_batches: list[float] = []
    with feeder(dataset, batch, 4 * 2) as actor:  # chunks as a job cuts them: a step's rows
        stream = StreamRows(FedStream(actor, rows, batch, "tokens", TIMEOUT_S))
        for round_ in range(rounds + 1):
            rates = (ringleader_rate(stream, batch, shards), iter_batches_rate(dataset, batch), iter_torch_batches_rate(dataset, batch))
            if round_:
                for kept, rate in zip((ours, plain, torch_batches), rates):
                    kept.append(rate)
        stats = ray.get(actor.stats.remote(), timeout=TIMEOUT_S)
    return {
        "rows": rows, "seq_len": seq_len, "batch": batch, "shards": shards,
        "ringleader_samples_per_s": statistics.median(ours), "iter_batches_samples_per_s": statistics.median(plain),
        "iter_torch_batches_samples_per_s": statistics.median(torch_batches),
        "ratio": statistics.median(ours) / statistics.median(plain), "feeder": stats,
    }


def resume_figures(at_row: int, seq_len: int, chunk_rows: int) -> dict[str, Any]:
    """A fresh feeder's first chunk at row 0 and at ``at_row`` (RESUME_ROWS in the bench)."""
    dataset = pipeline(at_row + 10 * chunk_rows, seq_len, blocks=200)
    timed, skipped = {}, {}
    for name, row in (("row_0", 0), ("row_1e6", at_row)):
        with feeder(dataset, chunk_rows, 8) as actor:
            started = time.perf_counter()
            ray.get(ray.get(actor.chunks.remote([row // chunk_rows]), timeout=TIMEOUT_S), timeout=TIMEOUT_S)
            timed[name] = time.perf_counter() - started
            skipped[name] = ray.get(actor.stats.remote(), timeout=TIMEOUT_S)["blocks_skipped"]
    return {"first_chunk_s": timed, "blocks_skipped": skipped}


def stream_figures(rows: int, seq_len: int, rounds: int) -> dict[str, Any]:
    """Every figure of the module, in a local Ray of its own (stopped after)."""
    with tempfile.TemporaryDirectory(prefix="rl-bench-ray-") as scratch:
        ray.init(address="local", include_dashboard=False, logging_level="ERROR", _temp_dir=scratch, log_to_driver=False)
        try:
            from ray.data import DataContext

            DataContext.get_current().enable_progress_bars = False
            logging.getLogger("ray.data").setLevel(logging.WARNING)  # a line per pass otherwise
            return {
                "reader": reader_figures(rows, seq_len, batch=32, shards=8, rounds=rounds),
                "resume": resume_figures(RESUME_ROWS, seq_len=8, chunk_rows=32),
            }
        finally:
            ray.shutdown()


def format_stream_figures(figures: dict[str, Any]) -> str:
    reader, resume = figures["reader"], figures["resume"]
    feeder_stats, timed = reader["feeder"], resume["first_chunk_s"]
    return "\n".join([
        f"Ray Data stream ({reader['rows']} rows of {reader['seq_len']} tokens, batch {reader['batch']}, {reader['shards']} shards):",
        f"  Ray Data iter_batches        {reader['iter_batches_samples_per_s']:>10.0f} samples/s",
        f"  Ray Data iter_torch_batches  {reader['iter_torch_batches_samples_per_s']:>10.0f} samples/s  (what a Ray Train worker iterates)",
        f"  ringleader, feeder + shards  {reader['ringleader_samples_per_s']:>10.0f} samples/s  ({reader['ratio']:.2f}x iter_batches)",
        f"  feeder held at most {feeder_stats['max_held_bytes'] / 2**20:.2f} MiB "
        f"(bound {feeder_stats['held_chunks_bound']} chunks of {feeder_stats['chunk_rows']} rows)",
        f"stream resume at 10^6 rows: first chunk {timed['row_1e6']:.2f} s ({resume['blocks_skipped']['row_1e6']} "
        f"blocks skipped unread); at row 0: {timed['row_0']:.2f} s",
    ])
