"""The Python API (``import ringleader``): jobs with plain callables on the session's local
Ray, the same errors as the CLI, and a Hugging Face ``transformers`` model built from a config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ringleader
from tests.helpers.jobs import REORDERED, Reference, Yardstick, assert_same_params, jsonl
from tests.helpers.paths import REPO

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _sequences_job() -> dict:
    """The padded-sequence job of tests.helpers.losses, given as callables defined here (so
    Ray must ship them by value: they import from nowhere)."""
    from tests.helpers import losses

    def model() -> torch.nn.Module:
        return losses.make_model(width=16)

    def data() -> list:
        return losses.make_sequences(n=96)

    def loss(net: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return losses.token_loss(net, batch)

    return {
        "name": "api", "model": {"factory": model}, "dataset": {"factory": data, "collate": losses.pad_collate},
        "eval": None, "loss": loss, "optimizer": {"name": torch.optim.Adagrad, "kwargs": {"lr": 0.05}},
        "batch_size": 24, "shards": 4, "steps": 8,
    }


def _one_worker(job: dict, run_dir: Path) -> Reference:
    """``job`` run on one worker into ``run_dir``, with its yardstick: the same again (into
    ``run_dir``'s sibling ``-reordered``) with each step's shards in a shuffled order."""
    one = ringleader.run(job, run_dir, overrides=["scaling.workers=1"])
    reordered = ringleader.run(job, run_dir.with_name(f"{run_dir.name}-reordered"), overrides=["scaling.workers=1", REORDERED])
    assert one.status == reordered.status == "finished", (one.error, reordered.error)
    state = one.model_state()
    return Reference(state, Yardstick.measure(state, reordered.model_state(), f"one worker, {REORDERED}"), one.run_dir)


def test_a_job_of_callables_trains_like_the_same_job_of_import_paths(tmp_path):
    by_value = ringleader.run(_sequences_job(), tmp_path / "callables", overrides=["scaling.workers=2"])
    assert by_value.status == "finished", by_value.error
    assert by_value.summary["shards_committed"] == 8 * 4
    h = "tests.helpers.losses"
    by_path = {
        "name": "api", "model": {"factory": f"{h}:make_model", "kwargs": {"width": 16}},
        "dataset": {"factory": f"{h}:make_sequences", "kwargs": {"n": 96}, "collate": f"{h}:pad_collate"},
        "eval": None, "loss": f"{h}:token_loss", "optimizer": {"name": "Adagrad", "kwargs": {"lr": 0.05}},
        "batch_size": 24, "shards": 4, "steps": 8, "scaling": {"workers": 1},
    }
    assert_same_params(by_value.model_state(), _one_worker(by_path, tmp_path / "paths"), "callables vs import paths")
    # job.json names the callables; these are local functions, so resuming needs the job again.
    with pytest.raises(ringleader.ConfigError, match="(?s)'model.factory'.*pass job= again"):
        ringleader.resume(tmp_path / "callables", overrides=["steps=10"])
    again = ringleader.resume(tmp_path / "callables", _sequences_job(), overrides=["steps=10", "scaling.workers=2"])
    assert again.status == "finished" and again.summary["steps"] == 10


@pytest.mark.parametrize(
    "job, expected",
    [
        ({"batch_size": 0}, "field 'batch_size'"),
        ({"loss": 42}, "field 'loss'"),
        ({"optimizer": {"name": "NoSuchOptimizer"}}, "field 'optimizer.name': torch.optim has no optimizer"),
        ({"model": {"factory": "json:__name__"}}, "field 'model.factory'"),
    ],
)
def test_a_bad_job_through_the_api_raises_config_error_naming_the_field(tmp_path, job, expected):
    with pytest.raises(ringleader.ConfigError, match=expected):
        ringleader.run(job, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_a_hugging_face_model_from_a_config_trains_through_a_loss_sum_and_weight(tmp_path):
    """GPT-2 from ``transformers`` (random init from a config, no download) on the shipped
    token file, through a user loss returning (loss_sum, weight): 2 workers end where 1 does."""
    transformers = pytest.importorskip("transformers")

    def model() -> torch.nn.Module:
        config = transformers.GPT2Config(
            vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(config)

    def data() -> torch.utils.data.Dataset:
        from ringleader_examples.gpt import make_dataset

        return make_dataset(block_size=32)

    def next_token_loss(net: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        logits = net(input_ids=ids).logits[:, :-1]
        labels = ids[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum"), labels.numel()

    job = {
        "name": "hf", "model": {"factory": model}, "dataset": {"factory": data}, "eval": None,
        "loss": next_token_loss, "optimizer": {"name": "adamw", "kwargs": {"lr": 0.003}, "clip_grad_norm": 1.0},
        "batch_size": 16, "shards": 4, "steps": 6,
    }
    # The attention's key bias has a zero true gradient (softmax ignores a shift shared by all
    # keys), so its gradient is float noise, which AdamW turns into updates of ~1e-6 that differ
    # with the summation order: the yardstick's re-ordered run measures that too.
    one = _one_worker(job, tmp_path / "one")
    two = ringleader.run(job, tmp_path / "two", overrides=["scaling.workers=2"])
    assert two.status == "finished", two.error
    steps = [e for e in jsonl(two.run_dir / "events.jsonl") if e["event"] == "step"]
    assert all(e["weight"] == 16 * 31 for e in steps)  # tokens predicted per step
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert_same_params(two.model_state(), one, "transformers GPT-2")


def test_the_docs_example_runs_as_written(tmp_path, monkeypatch):
    """docs/python-api.md's example, executed as a script would run it (its functions live in
    ``__main__``, so Ray ships them by value), in a scratch directory."""
    import re

    doc = (REPO / "docs" / "python-api.md").read_text()
    section = doc[doc.index("# Python API") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    printed: list[tuple] = []
    exec(compile(code, "docs/python-api.md", "exec"), {"__name__": "__main__", "print": lambda *a: printed.append(a)})
    (status, metrics, samples_per_s), (more_status, more_metrics) = printed
    assert status == more_status == "finished" and samples_per_s > 0
    assert more_metrics["loss"] < metrics["loss"] < 5.55  # ln(256): better than chance, then better still
    assert [e for e in (tmp_path / "runs" / "bytes" / "events.jsonl").read_text().splitlines() if '"resume"' in e]
