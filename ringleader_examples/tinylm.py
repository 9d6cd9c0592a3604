"""A small character-level transformer language model on text that ships with the package.

The corpus is ``data/stdlib_docs.txt`` (see ``data/README.md``). Samples are non-overlapping
windows of ``seq_len + 1`` characters: inputs are the first ``seq_len``, targets the next
character at each position. The last ``test_fraction`` of windows is the test split.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch
from torch.utils.data import TensorDataset

CORPUS = Path(__file__).parent / "data" / "stdlib_docs.txt"
# Printable ASCII plus newline: every character the corpus may hold has an id.
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))


@lru_cache(maxsize=1)
def _encoded() -> torch.Tensor:
    text = CORPUS.read_text(encoding="ascii")
    lookup = {ch: i for i, ch in enumerate(VOCAB)}
    return torch.tensor([lookup[ch] for ch in text], dtype=torch.int64)


def make_dataset(
    split: Literal["train", "test"] = "train", seq_len: int = 64, test_fraction: float = 0.1
) -> TensorDataset:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    ids = _encoded()
    windows = ids[: len(ids) // (seq_len + 1) * (seq_len + 1)].view(-1, seq_len + 1)
    cut = int(len(windows) * (1 - test_fraction))
    chosen = windows[:cut] if split == "train" else windows[cut:]
    return TensorDataset(chosen[:, :-1].contiguous(), chosen[:, 1:].contiguous())


class TinyLM(torch.nn.Module):
    """Token + position embeddings, a causal pre-norm transformer encoder, a linear head."""

    def __init__(
        self, d_model: int = 128, layers: int = 2, heads: int = 4, seq_len: int = 64, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.token = torch.nn.Embedding(len(VOCAB), d_model)
        self.position = torch.nn.Embedding(seq_len, d_model)
        block = torch.nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=dropout, batch_first=True, norm_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, len(VOCAB))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [batch, time]`` -> logits ``[batch, time, vocab]``."""
        length = ids.shape[1]
        x = self.token(ids) + self.position(torch.arange(length, device=ids.device))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        return self.head(self.norm(self.encoder(x, mask=mask, is_causal=True)))


def make_model(d_model: int = 128, layers: int = 2, heads: int = 4, seq_len: int = 64, dropout: float = 0.0) -> TinyLM:
    return TinyLM(d_model, layers, heads, seq_len, dropout)
