"""Streams (``dataset.ray_data``) in whole jobs on a real cluster: parquet files read and
tokenized by Ray Data, and a streaming Hugging Face dataset, fed through a feeder actor; every
sample once by the ledger through a SIGKILL with stragglers and across a resume on another
worker count mid-epoch; a shuffle without a seed refused before training."""

from __future__ import annotations

import json

import pytest

import ringleader

from benchmarks.data_stream import format_stream_figures, reader_figures, resume_figures
from jobspec.fields import ConfigError
from orchestrator.job.reading import load_job
from orchestrator.data.streams import fed_streams, feeder_path, leave_room_for_streams, stream_path
from orchestrator.launch import run_job
from tests.helpers.jobs import assert_control_differs, assert_same_params, jsonl, params, run
from tests.helpers.ledger import BATCH, LEDGER_JOB, SEQ, assert_exactly_once, consumed, expected
from tests.helpers.streams import hf_stream_ids, make_stream, stream_ids, write_numbered_text

pytestmark = pytest.mark.usefixtures("ray_cluster")

BLOCKS_SEED = 3


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    return str(write_numbered_text(tmp_path_factory.mktemp("text")))


def _stream(directory: str, **kwargs: object) -> str:
    extra = "".join(f", {k}: {v}" for k, v in kwargs.items())
    return f"dataset={{ray_data: tests.helpers.streams:make_stream, kwargs: {{directory: '{directory}'{extra}}}, column: tokens}}"


def _feeder(run_dir) -> dict:
    return json.loads(feeder_path(run_dir, "dataset").read_text())


def test_a_stream_trains_every_sample_once_through_a_kill_and_stragglers(tmp_path, text):
    order = stream_ids(text, blocks_seed=BLOCKS_SEED)
    assert sorted(order) == list(range(40)) and list(order) != sorted(order)  # the pipeline's own order
    # Through the Python API: ringleader.run(..., dataset=ds).
    result = ringleader.run(None, tmp_path / "kill", dataset=make_stream(text, blocks_seed=BLOCKS_SEED), overrides=[
        *LEDGER_JOB, "dataset.column=tokens", "steps=12", "scaling.workers=3",
        "collective.algorithm=ring", "chaos.kill=[{at_step: 3, worker: 1, how: sigkill}]",
        "chaos.slow=[{worker: 0, factor: 8, from_step: 5, to_step: 7}, {worker: 2, factor: 8, from_step: 6, to_step: 9}]",
        "stragglers.late_factor=1.2", "stragglers.min_ratio=1.2", "stragglers.persistent_steps=1",
        "stragglers.window=2", "stragglers.evict=false",
    ])
    assert result.status == "finished" and result.summary["events"]["failures"] == 1, result.error
    assert_exactly_once(consumed(params(result.run_dir)), expected(12, stream=order), "a stream through a kill")
    feeder = _feeder(result.run_dir)
    # The bound held: never more chunks than it allows (a chunk is a step's rows of int64 tokens).
    assert feeder["chunk_rows"] == BATCH and 0 < feeder["max_held_bytes"] <= feeder["held_chunks_bound"] * BATCH * SEQ * 8, feeder


def test_a_stream_resumes_mid_epoch_on_another_worker_count(tmp_path, text):
    """Through the Python API, as docs/python-api.md says: the job and the dataset passed again."""
    order = stream_ids(text)
    first = ringleader.run(None, tmp_path / "run", dataset=make_stream(text), overrides=[
        *LEDGER_JOB, "dataset.column=tokens", "steps=4", "scaling.workers=2", "checkpoint.every_steps=4",
    ])
    assert first.status == "finished", first.error
    job = load_job(None, [*LEDGER_JOB, "dataset.column=tokens", "steps=12", "scaling.workers=3", "checkpoint.every_steps=4"])
    resumed = ringleader.resume(tmp_path / "run", job, dataset=make_stream(text))
    assert resumed.status == "finished", resumed.error
    assert [e["checkpoint"] for e in jsonl(resumed.run_dir / "events.jsonl") if e["event"] == "resume"] == ["step-00000004"]
    assert_exactly_once(consumed(params(resumed.run_dir)), expected(12, stream=order), "a stream resumed on 3 workers")
    # The resumed feeder started its first pass 24 rows in: the blocks before were skipped unread.
    assert _feeder(resumed.run_dir)["blocks_skipped"] > 0


@pytest.mark.parametrize(("unseeded", "how", "named"), [
    ("rows", "job", r"RandomShuffle"),
    ("rows", "api", r"RandomShuffle"),
    ("files", "job", r"ListFiles: a new seed each pass"),
    ("reseeded", "job", r"ListFiles: reseeded each pass"),
])
def test_a_stream_whose_order_changes_from_pass_to_pass_is_refused_before_training(tmp_path, text, unseeded, how, named):
    match = rf"field 'dataset.ray_data': the dataset's order changes from pass to pass \({named}\)"
    with pytest.raises(ConfigError, match=match):
        if how == "job":  # the job names the function
            run_job(load_job(None, [*LEDGER_JOB, _stream(text, unseeded=unseeded), "steps=2"]), run_dir=tmp_path / "run")
        else:  # ringleader.run(..., dataset=ds)
            ringleader.run(None, tmp_path / "run", overrides=[*LEDGER_JOB, "steps=2"], dataset=make_stream(text, unseeded=unseeded))
    assert not [e for e in jsonl(tmp_path / "run" / "events.jsonl") if e["event"] in ("workers_ready", "step")]


def test_the_text_stream_example_feeds_the_gpt_recipe_and_its_eval(tmp_path):
    """README's Ray Data example: the shipped text read, tokenized and packed by Ray Data; an
    eval set streamed the same way (a small text: eval reads it whole)."""
    seq = 32
    val = tmp_path / "val.txt"
    val.write_text("".join(f"line {i} of the held-out text\n" for i in range(100)))
    result = run(
        tmp_path, "gpt", f"model={{factory: ringleader_examples.gpt:make_model, kwargs: {{block_size: {seq}, n_layer: 1, n_head: 2, n_embd: 32}}}}",
        "loss=causal_lm", "batch_size=16", "shards=4", "steps=3", "scaling.workers=2",
        f"dataset={{ray_data: ringleader_examples.text_stream:make_dataset, kwargs: {{block_size: {seq}}}, column: tokens}}",
        f"eval={{ray_data: ringleader_examples.text_stream:make_dataset, kwargs: {{path: '{val}', block_size: {seq}}}, "
        "column: tokens, batch_size: 16}",
    )
    losses = [e["loss"] for e in jsonl(result.run_dir / "events.jsonl") if e["event"] == "step"]
    assert len(losses) == 3 and all(0 < loss < 7 for loss in losses), losses  # ln(256) = 5.5 at the start
    assert 0 < result.summary["eval"]["loss"] < 7, result.summary["eval"]
    assert json.loads((result.run_dir / "data" / "eval-stream.json").read_text())["samples"] == len(val.read_bytes()) // seq
    stream = json.loads((result.run_dir / "data" / "dataset-stream.json").read_text())
    assert stream["samples"] > 1000  # ~40k windows of 32 bytes


def test_bench_data_measures_the_stream_reader_its_bound_and_a_resume():
    """``ringleader bench data``'s Ray Data figures, small (the bench runs them in a Ray of its own)."""
    reader = reader_figures(rows=640, seq_len=16, batch=32, shards=8, rounds=1)
    assert min(reader[f"{name}_samples_per_s"] for name in ("ringleader", "iter_batches", "iter_torch_batches")) > 0
    # Each pass whole (one untimed, one timed), never more than the bound's 8 chunks of 32 rows held.
    assert reader["feeder"]["chunks_made"] == 2 * 640 // 32 and reader["feeder"]["max_held_bytes"] == 8 * 32 * 16 * 8
    resume = resume_figures(at_row=640, seq_len=8, chunk_rows=32)
    assert resume["blocks_skipped"]["row_0"] == 0 < resume["blocks_skipped"]["row_1e6"]
    text = format_stream_figures({"reader": reader, "resume": resume})
    assert "x iter_batches" in text and "blocks skipped unread" in text


def test_a_stream_needs_a_cpu_the_workers_leave_free(text):
    """Ray Data's tasks take a CPU each: workers holding all of a fixed cluster's (4 here) would
    leave its first read waiting until it timed out. Refused on a fixed cluster, a warning on
    one that may grow; half a CPU a worker leaves room."""
    def job(cpu: float):
        return load_job(None, [*LEDGER_JOB, _stream(text), "scaling.workers=4", f"scaling.resources_per_worker={{CPU: {cpu}}}"])

    with pytest.raises(ConfigError, match=r"field 'scaling.resources_per_worker': a ray_data stream runs its pipeline in "
                       r"Ray tasks of a CPU each, and 4 workers x 1 CPU leave 0 of the cluster's 4"):
        leave_room_for_streams(job(1), fixed_cluster=True, warn=print)
    warned: list[str] = []
    leave_room_for_streams(job(1), fixed_cluster=False, warn=warned.append)
    leave_room_for_streams(job(0.5), fixed_cluster=True, warn=warned.append)
    assert len(warned) == 1 and "leave 0 of the cluster's 4" in warned[0]


def test_a_streaming_hugging_face_dataset_trains_every_sample_once(tmp_path):
    """A ``datasets.IterableDataset`` (shuffled by a seeded buffer) through the same feeder: its
    rows without a ``column`` are dicts, as the dataset yields them."""
    order = hf_stream_ids(shuffle_seed=5)
    assert sorted(order) == list(range(40)) and list(order) != sorted(order)
    result = run(
        tmp_path, "hf", *LEDGER_JOB, "steps=6", "scaling.workers=2",
        "dataset={ray_data: tests.helpers.streams:make_hf_stream, kwargs: {shuffle_seed: 5}}",
    )
    assert_exactly_once(consumed(params(result.run_dir)), expected(6, stream=order), "a Hugging Face stream")


def test_a_stream_gives_one_workers_trajectory_on_three_through_a_kill(tmp_path, one_worker):
    """The GPT recipe from the Ray Data example: 3 workers and a SIGKILL end where one worker
    does (within the job's yardstick), and another block order does not (the control)."""
    seq = 32
    gpt = (
        f"model={{factory: ringleader_examples.gpt:make_model, kwargs: {{block_size: {seq}, n_layer: 1, n_head: 2, n_embd: 32}}}}",
        "loss=causal_lm", "batch_size=16", "shards=4", "steps=6",
    )

    def stream(blocks_seed: int) -> str:
        return (f"dataset={{ray_data: ringleader_examples.text_stream:make_dataset, "
                f"kwargs: {{block_size: {seq}, blocks_seed: {blocks_seed}}}, column: tokens}}")

    reference = one_worker(*gpt, stream(0))
    killed = run(tmp_path, "kill", *gpt, stream(0), "scaling.workers=3", "chaos.kill=[{at_step: 2, worker: 1, how: sigkill}]")
    assert killed.summary["events"]["failures"] == 1
    assert_same_params(params(killed.run_dir), reference, "a stream on 3 workers through a SIGKILL")
    other = run(tmp_path, "other", *gpt, stream(1), "scaling.workers=3")
    assert_control_differs(params(other.run_dir), reference, "the stream's blocks in another order")


def test_a_resumed_run_whose_stream_changed_length_is_refused(tmp_path, text):
    """The row count a run began with is kept in its run directory: a resume whose pipeline
    yields another count (a file added, a filter changed) would read other rows at every step,
    and is refused before a worker starts; the feeder started to count is stopped."""
    source = load_job(None, [*LEDGER_JOB, _stream(text)]).dataset
    stream_path(tmp_path, "dataset").parent.mkdir()
    stream_path(tmp_path, "dataset").write_text(json.dumps({"samples": 39}))
    checked: list[str] = []
    with pytest.raises(ConfigError, match=r"field 'dataset.ray_data': the stream changed since the run began: 40 rows a pass, it had 39"):
        with fed_streams({"dataset": (source, 16)}, tmp_path, True, 120, print, lambda: checked.append("room")):
            pass
    assert json.loads(feeder_path(tmp_path, "dataset").read_text())["chunks_made"] == 0
    assert checked == ["room"]  # a Ray Data pipeline's tasks need a CPU: the launch checks there is one


def test_a_hugging_face_stream_needs_no_cpu_of_its_own(tmp_path):
    """The feeder iterates it itself: no Ray Data task, so no CPU check (a fixed cluster whose
    workers hold every CPU runs it)."""
    source = load_job(None, [*LEDGER_JOB, "dataset={ray_data: tests.helpers.streams:make_hf_stream}"]).dataset
    with fed_streams({"dataset": (source, 16)}, tmp_path, False, 120, print, lambda: pytest.fail("checked")) as fed:
        assert fed["dataset"].samples == 40
