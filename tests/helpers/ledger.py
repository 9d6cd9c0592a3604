"""An exactly-once ledger measured by training itself, not by the code that plans the shards.

The source: token files whose sample ``i`` (a window of ``SEQ`` tokens) holds its own id ``i``.
The model: one parameter per sample id, ``counts``. The loss of a sample is ``counts[id]``, so a
step's reduced gradient is the histogram of the ids the workers actually read and committed in
it, divided by the step's batch (the step's mean). Plain SGD at ``lr = BATCH`` under the schedule
``2**step`` then subtracts ``2**t`` times the histogram of step ``t``: at the end,
``-counts[i] = sum over steps t of (times id i was consumed in step t) * 2**t``, a binary
ledger of which steps consumed which sample, read from the trained parameters. Every addend is
a small dyadic number, so float32 holds it exactly (under 2**24): the comparison is exact, no
tolerance involved.

The expected ledger is the source's order as ``workers/data/shuffle.py`` defines it: positions
``[t * BATCH, (t + 1) * BATCH)`` of the stream of epochs, each epoch ``e`` ordered by
``epoch_order(shuffle, SAMPLES, seed, e)``; it never asks how shards were cut or who ran them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from workers.data.shuffle import epoch_order

SAMPLES = 40  # ids; a batch of 16 crosses an epoch boundary every 2.5 steps
BATCH = 16
SEQ = 2
FILES = 3


def write_id_tokens(directory: Path) -> str:
    """``FILES`` uint32 token files in ``directory`` laid end to end hold samples 0..SAMPLES-1,
    each ``SEQ`` copies of its id; returns the dataset field naming them (a glob)."""
    directory.mkdir(parents=True, exist_ok=True)
    for number, ids in enumerate(np.array_split(np.arange(SAMPLES, dtype=np.uint32), FILES)):
        np.repeat(ids, SEQ).tofile(directory / f"ids-{number:02d}.bin")
    return f"dataset={{files: '{directory}/*.bin', format: tokens, dtype: uint32, seq_len: {SEQ}}}"


class Ledger(torch.nn.Module):
    def __init__(self, samples: int = SAMPLES) -> None:
        super().__init__()
        self.counts = torch.nn.Parameter(torch.zeros(samples))

    def forward(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = batch["tokens"] if isinstance(batch, dict) else batch  # a row of columns, or its tokens
        return self.counts[tokens[:, 0]]


def make_ledger(samples: int = SAMPLES) -> Ledger:
    return Ledger(samples)


def ledger_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Per-sample losses: each sample's own count."""
    return model(batch)


def doubling(step: int, num_steps: int) -> float:
    return 2.0**step


#: The job's overrides, beside a dataset (``write_id_tokens``) and its steps.
LEDGER_JOB = (
    "model={factory: tests.helpers.ledger:make_ledger}", "loss=tests.helpers.ledger:ledger_loss",
    f"optimizer={{name: sgd, kwargs: {{lr: {BATCH}}}}}", "schedule.name=tests.helpers.ledger:doubling",
    f"batch_size={BATCH}", "shards=8", "eval=null",
)


def consumed(params: Mapping[str, torch.Tensor]) -> np.ndarray:
    """The ledger a run's final parameters hold (int64 per id)."""
    values = -params["counts"].double().numpy()
    ledger = np.rint(values).astype(np.int64)
    assert np.array_equal(ledger, values), "the ledger holds a value that is not a whole count"
    return ledger


def expected(steps: int, seed: int = 0, shuffle: str = "index", stream: np.ndarray | None = None) -> np.ndarray:
    """The ledger of a run of ``steps`` full steps that read every sample exactly as the source
    orders them: files in the epoch order ``shuffle`` names; a stream (the ids a pass yields,
    in order) the same in every epoch."""
    ledger = np.zeros(SAMPLES, np.int64)
    for step in range(steps):
        positions = np.arange(step * BATCH, (step + 1) * BATCH)
        for epoch in np.unique(positions // SAMPLES):
            offsets = positions[positions // SAMPLES == epoch] % SAMPLES
            ids = stream[offsets] if stream is not None else epoch_order(shuffle, SAMPLES, seed, int(epoch)).at(offsets)
            np.add.at(ledger, ids, 2**step)
    return ledger


def steps_of(value: int) -> list[int]:
    """The steps a ledger entry says consumed its id (a step that read it twice shows as the
    next step: such an entry never equals a clean one)."""
    return [bit for bit in range(value.bit_length()) if value >> bit & 1]


def assert_exactly_once(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Every id consumed in exactly the steps the source puts it in, or an error naming the ids."""
    wrong = np.flatnonzero(got != want)
    assert not len(wrong), f"{what}: " + "; ".join(
        f"id {i} consumed in steps {steps_of(int(got[i]))}, the source has it in {steps_of(int(want[i]))}"
        for i in wrong[:8]
    )
