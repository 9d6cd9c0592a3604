"""A job trained from indexed files on a real Ray cluster: a directory of token shards (made by
``prepare_tokens``) gives the trajectory of the same tokens read through the recipe's one-file
dataset, on two workers through a SIGKILL; the index is built by Ray tasks and kept in the run
directory; a resumed run whose files changed is refused before training."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs
import pytest

from jobspec.fields import ConfigError
from orchestrator.data.index import FILES_PER_TASK, index_path
from orchestrator.job.reading import load_job
from orchestrator.launch import run_job
from ringleader_examples.gpt import TOKENS
from ringleader_examples.prepare_tokens import main as prepare_tokens
from tests.helpers.jobs import assert_control_differs, assert_same_params, jsonl, params, run
from tests.helpers.s3_endpoint import s3_endpoint

pytestmark = pytest.mark.usefixtures("ray_cluster")

SEQ = 32
TINY_GPT = (
    f"model={{factory: ringleader_examples.gpt:make_model, kwargs: {{block_size: {SEQ}, n_layer: 1, n_head: 2, n_embd: 32}}}}",
    "loss=causal_lm", "batch_size=16", "shards=4", "steps=8",
)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The recipe's shipped text as a directory of token shards, more than one Ray task's worth."""
    out = tmp_path_factory.mktemp("tokens") / "shards"
    text = TOKENS.with_suffix(".txt")
    assert prepare_tokens([str(text), str(out), "--shard-tokens", str(SEQ * 512)]) == 0
    assert len(json.loads((out / "index.json").read_text())["train"]) > FILES_PER_TASK
    return out


def _files(directory: Path, split: str = "train") -> str:
    return f"{{files: '{directory / split}/*.bin', format: tokens, seq_len: {SEQ}}}"


def test_token_shards_train_as_the_one_file_dataset_does_through_a_kill(tmp_path, shards, one_worker):
    one_file = one_worker(*TINY_GPT, f"dataset={{factory: ringleader_examples.gpt:make_dataset, kwargs: {{block_size: {SEQ}}}}}")
    killed = run(
        tmp_path, "files", *TINY_GPT, f"dataset={_files(shards)}", "scaling.workers=2",
        "chaos.kill=[{at_step: 4, worker: 1, how: sigkill}]",
    )
    assert [e["event"] for e in jsonl(killed.run_dir / "events.jsonl")].count("recovered") >= 1
    assert_same_params(params(killed.run_dir), one_file, "token shards on 2 workers through a SIGKILL")
    kept = json.loads(index_path(killed.run_dir, "dataset").read_text())
    assert [Path(f["uri"]).name for f in kept["files"]] == sorted(p.name for p in (shards / "train").glob("*.bin"))
    # The control: the same shards listed in another order are other windows at each step.
    reversed_list = sorted((str(p) for p in (shards / "train").glob("*.bin")), reverse=True)
    other = run(tmp_path, "reversed", *TINY_GPT, f"dataset={{files: {reversed_list}, format: tokens, seq_len: {SEQ}}}")
    assert_control_differs(params(other.run_dir), one_file, "the shards in reverse order")


def test_token_shards_on_s3_train_and_checkpoint_there_and_resume(tmp_path, shards, one_worker):
    """The shards in a bucket of a real S3 endpoint on localhost, checkpoints in another: a run
    stopped after 4 steps resumes from its S3 checkpoint to the one-file trajectory; no secret of
    the URIs reaches the run directory."""
    one_file = one_worker(*TINY_GPT, f"dataset={{factory: ringleader_examples.gpt:make_dataset, kwargs: {{block_size: {SEQ}}}}}")
    with s3_endpoint() as s3:
        for p in sorted((shards / "train").glob("*.bin")):
            s3.upload(p, f"data/train/{p.name}")
        s3.filesystem().create_dir("checkpoints")
        job = (
            *TINY_GPT, "scaling.workers=2", f"dataset={{files: '{s3.uri('data/train/*.bin')}', format: tokens, seq_len: {SEQ}}}",
            f"checkpoint.path='{s3.uri('checkpoints/gpt')}'", "checkpoint.every_steps=2",
        )
        run(tmp_path, "s3", *job, "steps=4")
        resumed = run(tmp_path, "s3", *job)
        assert [e["checkpoint"] for e in jsonl(resumed.run_dir / "events.jsonl") if e["event"] == "resume"] == ["step-00000004"]
        written = s3.filesystem().get_file_info(pyarrow.fs.FileSelector("checkpoints/gpt", recursive=True))
        assert any(info.path.endswith("step-00000008/manifest.json") for info in written)
    assert_same_params(params(resumed.run_dir), one_file, "token shards on S3, resumed from an S3 checkpoint")
    for path in resumed.run_dir.rglob("*"):
        assert not path.is_file() or b"secret" not in path.read_bytes(), path


def test_a_resumed_run_whose_files_changed_is_refused_naming_the_file(tmp_path, shards):
    copy = tmp_path / "data"
    copy.mkdir()
    for p in (shards / "val").glob("*.bin"):
        (copy / p.name).write_bytes(p.read_bytes())
    job = [*TINY_GPT, f"dataset={{files: '{copy}/*.bin', format: tokens, seq_len: {SEQ}}}", "scaling.workers=1"]
    first = run(tmp_path, "run", *job, "steps=2", "checkpoint.every_steps=1")
    victim = sorted(copy.glob("*.bin"))[0]
    victim.write_bytes(victim.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=rf"'dataset.files': {victim} changed since the run indexed it \(size"):
        run_job(load_job(None, ["eval=null", *job, "steps=4"]), run_dir=first.run_dir)
