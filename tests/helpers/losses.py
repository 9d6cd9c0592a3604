"""A bring-your-own job for tests: dict batches of variable-length token sequences, padded by a
collate, a per-token model and a ``(loss_sum, weight)`` loss; plus bad losses and an fp16
overflow dataset."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VOCAB = 23
PAD = 0
IGNORE = -100


def make_sequences(n: int = 320, max_len: int = 12, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` items ``{"input_ids", "labels"}`` of 2..max_len tokens: shards get different
    token counts. The label of each token is a fixed function of it, so there is something to
    learn."""
    generator = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        length = int(torch.randint(2, max_len + 1, (1,), generator=generator))
        ids = torch.randint(1, VOCAB, (length,), generator=generator)
        items.append({"input_ids": ids, "labels": (ids * 7 + 3) % VOCAB})
    return items


def pad_collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad to the longest item of the batch; padded labels are ignored."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.full((len(items), longest), PAD, dtype=torch.int64)
    labels = torch.full((len(items), longest), IGNORE, dtype=torch.int64)
    mask = torch.zeros((len(items), longest), dtype=torch.int64)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = item["input_ids"], item["labels"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class TokenMLP(torch.nn.Module):
    """Per-position logits (no mixing across positions, so padding cannot change a real
    token's output). ``max_batch``: refuse larger batches (to check pass splitting)."""

    def __init__(self, width: int = 32, max_batch: int | None = None) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.hidden = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, VOCAB)
        self.max_batch = max_batch

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.max_batch is not None and input_ids.shape[0] > self.max_batch:
            raise RuntimeError(f"a pass of {input_ids.shape[0]} samples exceeds {self.max_batch}")
        return self.head(self.norm(torch.tanh(self.hidden(self.embed(input_ids)))))


def make_model(width: int = 32, max_batch: int | None = None) -> TokenMLP:
    return TokenMLP(width, max_batch)


def token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The user's loss: summed token cross-entropy over real tokens, and how many there are."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    labels = batch["labels"]
    total = F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return total, (labels != IGNORE).sum()


def token_accuracy(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """An eval metric: per sample, the fraction of its real tokens predicted right (summed)."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    kept = batch["labels"] != IGNORE
    right = ((logits.argmax(-1) == batch["labels"]) & kept).sum(dim=1)
    return {"token_accuracy": (right / kept.sum(dim=1)).sum()}


def mean_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The mistake the loss contract refuses: the batch's mean, not per-sample losses."""
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


def wrong_shape_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets, reduction="none")[:1]


def nan_weight_loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, float]:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets, reduction="sum"), float("nan")


def exploding_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets, reduction="none") * float("inf")


def make_bf16_digits_model() -> torch.nn.Module:
    from ringleader_examples.digits import make_model as digits_model

    return digits_model().to(torch.bfloat16)


def halving_schedule(step: int, num_steps: int) -> float:
    return 0.5 ** (step // 5)


def make_overflow_dataset(
    n: int = 256, hot: int | None = 7, seed: int = 0, warm: int | None = None
) -> torch.utils.data.TensorDataset:
    """The digits-like regression data where sample ``hot`` is huge: the step holding it
    overflows in fp16 (65504 is fp16's largest) whatever the loss scale, and no other does.
    Sample ``warm`` has a target of 1500: its step's scaled gradient (1500 * scale / 32 at the
    output, for batches of 32) overflows in fp16 at a loss scale of 2048 or more, not below."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, 8, generator=generator)
    targets = torch.randn(n, 2, generator=generator)
    if hot is not None:
        inputs[hot] = 1e6
    if warm is not None:
        inputs[warm], targets[warm] = 0.1, 1500.0  # a small input: only the output's gradient is large
    return torch.utils.data.TensorDataset(inputs, targets)


def make_regressor() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
