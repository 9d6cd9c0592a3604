"""A GPT-style decoder trained on a memory-mapped token file: the recipe of ``examples/gpt.yaml``.

Data is nanoGPT's format: a flat array of uint16 token ids on disk (``.bin``), read through
``numpy.memmap`` so a large corpus costs no memory. Samples are windows of ``block_size``
tokens at a fixed stride, indexed like any dataset: the shard sampler shuffles and deals
them, so the data cursor (which windows each step saw) stays exact through failures and
rescaling. The loss is ``causal_lm``: each position predicts the next token of its window.

``data/stdlib_docs.bin`` ships with the package: the bundled text (``data/stdlib_docs.txt``)
as bytes (vocabulary 256), made by ``python -m ringleader_examples.prepare_tokens``, which
prepares a token file from any text file the same way.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

TOKENS = Path(__file__).parent / "data" / "stdlib_docs.bin"
BYTE_VOCAB = 256


class TokenWindows(torch.utils.data.Dataset):
    """Windows of ``block_size`` token ids from a uint16 token file, ``stride`` apart, within
    ``[start, end)`` of the file's tokens (fractions). Items are int64 tensors ``[block_size]``."""

    def __init__(self, path: str | Path, block_size: int, stride: int, start: float = 0.0, end: float = 1.0) -> None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"token file {path} does not exist (make one with python -m ringleader_examples.prepare_tokens)")
        if path.stat().st_size % 2:
            raise ValueError(f"token file {path}: {path.stat().st_size} bytes is not a whole number of uint16 tokens")
        if block_size < 2 or stride < 1:
            raise ValueError(f"need block_size >= 2 and stride >= 1, got {block_size} and {stride}")
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        lo, hi = int(len(tokens) * start), int(len(tokens) * end)
        self.tokens = tokens[lo:hi]
        self.block_size, self.stride = block_size, stride
        self.windows = max(0, (len(self.tokens) - block_size) // stride + 1)
        if self.windows == 0:
            raise ValueError(f"token file {path}: {hi - lo} tokens hold no window of {block_size}")

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.windows:
            raise IndexError(f"window {index} of {self.windows}")
        lo = index * self.stride
        return torch.from_numpy(self.tokens[lo : lo + self.block_size].astype(np.int64))


def make_dataset(
    split: Literal["train", "val"] = "train",
    block_size: int = 128,
    stride: int | None = None,
    path: str | None = None,
    val_fraction: float = 0.1,
) -> TokenWindows:
    """The train split (the first ``1 - val_fraction`` of the tokens) or the val split (the
    rest) of ``path`` (default: the shipped token file); ``stride`` defaults to ``block_size``
    (non-overlapping windows)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    cut = 1.0 - val_fraction
    start, end = (0.0, cut) if split == "train" else (cut, 1.0)
    return TokenWindows(path or TOKENS, block_size, stride or block_size, start, end)


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.qkv = torch.nn.Linear(n_embd, 3 * n_embd)
        self.proj = torch.nn.Linear(n_embd, n_embd)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class Block(torch.nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(n_embd), torch.nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(n_embd, 4 * n_embd), torch.nn.GELU(), torch.nn.Linear(4 * n_embd, n_embd), torch.nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    """Pre-norm decoder-only transformer with learned positions and a head tied to the token
    embedding (GPT-2's layout); ``forward(ids [batch, time]) -> logits [batch, time, vocab]``."""

    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.token = torch.nn.Embedding(vocab_size, n_embd)
        self.position = torch.nn.Embedding(block_size, n_embd)
        self.drop = torch.nn.Dropout(dropout)
        self.blocks = torch.nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln = torch.nn.LayerNorm(n_embd)
        self.head = torch.nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.token.weight
        self.apply(self._init)
        for name, param in self.named_parameters():  # GPT-2: scaled init of residual projections
            if name.endswith(("proj.weight", "mlp.2.weight")):
                torch.nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: torch.nn.Module) -> None:
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        if length > self.block_size:
            raise ValueError(f"sequence of {length} tokens exceeds block_size {self.block_size}")
        x = self.drop(self.token(ids) + self.position(torch.arange(length, device=ids.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_model(
    vocab_size: int = BYTE_VOCAB, block_size: int = 128, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
    dropout: float = 0.0,
) -> GPT:
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
