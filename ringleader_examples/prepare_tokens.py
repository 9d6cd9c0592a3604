"""Prepare a token file for ``ringleader_examples.gpt``: any text file as uint16 token ids.

    python -m ringleader_examples.prepare_tokens INPUT.txt OUTPUT.bin

Tokens are the text's UTF-8 bytes (vocabulary 256, so ``vocab_size: 256``), written as
nanoGPT's flat little-endian uint16 array. The output is written to a temporary file, flushed
and renamed into place, so an interrupted run never leaves a half-written token file.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", type=Path, help="a UTF-8 text file")
    parser.add_argument("output", type=Path, help="the token file to write (.bin)")
    args = parser.parse_args(argv)
    try:
        text = args.input.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        print(f"prepare_tokens: cannot read {args.input} as UTF-8 text: {err}", file=sys.stderr)
        return 2
    tokens = encode_bytes(text)
    write_tokens(tokens, args.output)
    print(f"prepare_tokens: {len(tokens)} tokens -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
