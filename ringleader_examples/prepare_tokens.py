"""Prepare token files for ``ringleader_examples.gpt``: any text file as uint16 token ids.

    python -m ringleader_examples.prepare_tokens INPUT.txt OUTPUT.bin   # one token file
    python -m ringleader_examples.prepare_tokens INPUT.txt OUTDIR       # a directory of shards

Tokens are the text's UTF-8 bytes (vocabulary 256, so ``vocab_size: 256``), written as
nanoGPT's flat little-endian uint16 array. A directory holds ``train/`` (the first
``1 - --val-fraction`` of the tokens) and ``val/`` (the rest), each as token shard files of
``--shard-tokens`` tokens (the last shorter), and ``index.json`` listing them with their token
counts, written last: a job reads them as ``dataset: {files: OUTDIR/train/*.bin, format: tokens,
seq_len: ...}``. With ``--shard-tokens`` a multiple of ``seq_len`` its samples are the windows
``gpt:make_dataset`` cuts from the one-file form. Every file is written to a temporary file,
flushed and renamed into place, so an interrupted run never leaves a half-written one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from jobspec.durable import write_atomic


def encode_bytes(text: str) -> np.ndarray:
    """The UTF-8 bytes of ``text`` as uint16 token ids."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype("<u2")


def write_tokens(tokens: np.ndarray, output: Path) -> None:
    """Write ``tokens`` (uint16) to ``output`` atomically (temp file, fsync, rename), readable
    by others as any new file would be."""
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(output, lambda out: out.write(np.ascontiguousarray(tokens, dtype="<u2").tobytes()), shared=True)


def write_shards(tokens: np.ndarray, output: Path, shard_tokens: int, val_fraction: float) -> dict[str, object]:
    """``tokens`` as a directory of shards (see the module's docstring); returns its index."""
    cut = int(len(tokens) * (1.0 - val_fraction))  # where gpt:make_dataset cuts train from val
    index: dict[str, object] = {"dtype": "uint16", "tokens": len(tokens)}
    for split, part in (("train", tokens[:cut]), ("val", tokens[cut:])):
        shards = []
        for number, start in enumerate(range(0, len(part), shard_tokens)):
            name = f"{split}/tokens-{number:05d}.bin"
            write_tokens(part[start : start + shard_tokens], output / name)
            shards.append({"file": name, "tokens": len(part[start : start + shard_tokens])})
        index[split] = shards
    text = json.dumps(index, indent=1).encode()
    write_atomic(output / "index.json", lambda out: out.write(text), shared=True)
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", type=Path, help="a UTF-8 text file")
    parser.add_argument("output", type=Path, help="the token file to write (.bin), or else a directory of shards")
    parser.add_argument("--shard-tokens", type=int, default=1 << 20, help="tokens per shard file (a directory)")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="the tokens of val/ (a directory)")
    args = parser.parse_args(argv)
    if args.shard_tokens < 1 or not 0.0 <= args.val_fraction < 1.0:
        print("prepare_tokens: need --shard-tokens >= 1 and 0 <= --val-fraction < 1", file=sys.stderr)
        return 2
    try:
        text = args.input.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        print(f"prepare_tokens: cannot read {args.input} as UTF-8 text: {err}", file=sys.stderr)
        return 2
    tokens = encode_bytes(text)
    if args.output.suffix == ".bin":
        write_tokens(tokens, args.output)
        print(f"prepare_tokens: {len(tokens)} tokens -> {args.output}")
        return 0
    index = write_shards(tokens, args.output, args.shard_tokens, args.val_fraction)
    files = len(index["train"]) + len(index["val"])  # type: ignore[arg-type]
    print(f"prepare_tokens: {len(tokens)} tokens -> {files} shard files in {args.output} (index.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
