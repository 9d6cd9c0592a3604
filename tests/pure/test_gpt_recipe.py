"""The LM recipe's parts without Ray: token files (nanoGPT's uint16 format), the window
dataset, the GPT model under the causal-LM loss, and examples/gpt.yaml."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from orchestrator.job.reading import load_job
from ringleader_examples.gpt import TOKENS, TokenWindows, make_dataset, make_model
from ringleader_examples.prepare_tokens import main as prepare_tokens
from workers.model.objective import Objective


def test_a_text_file_becomes_a_token_file_of_its_bytes(tmp_path):
    (tmp_path / "in.txt").write_text("héllo world\n", encoding="utf-8")
    assert prepare_tokens([str(tmp_path / "in.txt"), str(tmp_path / "out" / "t.bin")]) == 0
    tokens = np.fromfile(tmp_path / "out" / "t.bin", dtype="<u2")
    assert bytes(tokens.astype(np.uint8)) == "héllo world\n".encode("utf-8")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["t.bin"]  # no temp file left


def test_a_directory_of_shards_holds_the_one_file_forms_windows_in_the_same_order(tmp_path):
    """Shards of a multiple of ``seq_len`` tokens, read as indexed files, are the windows
    ``make_dataset`` cuts from the one-file form, train and val alike, in the same order."""
    from jobspec.recipe import DatasetSpec
    from orchestrator.data.index import build_index
    from workers.data.files import IndexedFiles

    (tmp_path / "in.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    assert prepare_tokens([str(tmp_path / "in.txt"), str(tmp_path / "one.bin")]) == 0
    assert prepare_tokens([str(tmp_path / "in.txt"), str(tmp_path / "shards"), "--shard-tokens", "96"]) == 0
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert len(index["train"]) == 17 and sum(s["tokens"] for s in index["train"] + index["val"]) == index["tokens"] == 1800
    for split in ("train", "val"):
        one = make_dataset(split, block_size=16, path=str(tmp_path / "one.bin"))
        files = DatasetSpec(files=str(tmp_path / "shards" / split / "*.bin"), format="tokens", seq_len=16)
        shards = IndexedFiles(build_index(files, "dataset", 30))
        assert len(shards) == len(one) and all(torch.equal(shards[i], one[i]) for i in range(len(one)))


def test_an_unreadable_input_exits_2_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "in.txt").write_bytes(b"\xff\xfe not utf-8")
    assert prepare_tokens([str(tmp_path / "in.txt"), str(tmp_path / "t.bin")]) == 2
    assert "cannot read" in capsys.readouterr().err and not (tmp_path / "t.bin").exists()


def test_windows_are_strided_slices_of_the_token_file(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(100, dtype="<u2").tofile(path)
    windows = TokenWindows(path, block_size=8, stride=5)
    assert len(windows) == (100 - 8) // 5 + 1
    assert windows[3].tolist() == list(range(15, 23)) and windows[3].dtype == torch.int64
    with pytest.raises(IndexError):
        windows[len(windows)]
    val = TokenWindows(path, block_size=8, stride=8, start=0.9)
    assert val[0].tolist() == list(range(90, 98))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        TokenWindows(tmp_path / "odd.bin", 2, 1)
    with pytest.raises(ValueError, match="does not exist"):
        TokenWindows(tmp_path / "none.bin", 2, 1)


def test_the_shipped_token_file_is_the_bundled_text():
    text = (TOKENS.parent / "stdlib_docs.txt").read_bytes()
    assert np.fromfile(TOKENS, dtype="<u2").astype(np.uint8).tobytes() == text
    train, val = make_dataset("train", block_size=64), make_dataset("val", block_size=64)
    assert len(train) > 8 * len(val) > 0


def test_the_gpt_learns_under_the_causal_lm_loss():
    torch.manual_seed(0)
    model = make_model(block_size=32, n_layer=1, n_head=2, n_embd=32)
    assert model.head.weight is model.token.weight  # tied
    batch = torch.stack([make_dataset(block_size=32)[i] for i in range(8)])
    objective = Objective("causal_lm")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = objective(model, batch, 8)
        assert loss.weight == 8 * 31
        optimizer.zero_grad()
        (loss.total / loss.weight).backward()
        optimizer.step()
        losses.append(float(loss.total.detach()) / loss.weight)
    assert losses[0] == pytest.approx(np.log(256), rel=0.05) and losses[-1] < 0.7 * losses[0]


def test_examples_gpt_yaml_is_the_documented_recipe():
    job = load_job("examples/gpt.yaml")
    assert (job.loss.name, job.precision, job.schedule.name) == ("causal_lm", "bf16", "warmup_cosine")
    assert job.optimizer.name == "adamw" and job.optimizer.clip_grad_norm == 1.0
    assert not job.optimizer.decay_biases_and_norms
