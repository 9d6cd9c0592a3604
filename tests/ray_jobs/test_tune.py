"""``ringleader tune``: parameters parsed with clear errors, and a small digits sweep on the
session's Ray whose trials are elastic jobs inside their trials' placement groups."""

from __future__ import annotations

import json

import pytest

from jobspec.fields import ConfigError
from orchestrator.commands.tune import format_ranking, parse_param, run_sweep


def test_params_parse_into_tune_distributions():
    assert parse_param("optimizer.kwargs.lr=loguniform(1e-4, 1e-1)").args == (1e-4, 1e-1)
    assert parse_param("batch_size=choice([64, 128])").args == (64, 128)
    assert parse_param("seed=grid(0, 1, 2)").args == (0, 1, 2)
    for bad, expected in [
        ("lr", "expected FIELD=DISTRIBUTION(ARGS)"),
        ("lr=normal(0, 1)", "unknown distribution 'normal'"),
        ("lr=uniform(1)", "uniform takes two numbers"),
        ("lr=loguniform(0, 1)", "loguniform needs low > 0"),
        ("lr=choice(os.system)", "arguments are not Python literals"),
    ]:
        with pytest.raises(ConfigError) as err:
            parse_param(bad)
        assert expected in str(err.value) and repr(bad) in str(err.value)


@pytest.mark.usefixtures("ray_cluster")
def test_a_digits_sweep_ranks_elastic_trials_that_report_every_step(tmp_path):
    ranked = run_sweep(
        None, ["optimizer.kwargs.lr=grid(0.0001, 0.01)"], 1, scheduler="asha",
        overrides=["steps=8", "eval=null", "scaling={workers: 2, min_workers: 1, max_workers: 2}"], storage=tmp_path,
    )
    assert [row["status"] for row in ranked] == ["ok", "ok"]
    assert ranked[0]["config"] == {"optimizer.kwargs.lr": 0.01} and ranked[0]["step"] == 8  # the faster rate wins
    assert ranked[0]["loss"] < ranked[1]["loss"]
    for row in ranked:
        events = [json.loads(line) for line in open(f"{row['run_dir']}/events.jsonl")]
        steps = [e for e in events if e["event"] == "step"]
        assert {e["lr"] for e in steps} == {row["config"]["optimizer.kwargs.lr"]}
        # Tune saw the steps as they committed: all 8 of a trial run to the end; ASHA may stop
        # the worse one at its first rung (step 2), after which its in-flight steps still log.
        assert 2 <= row["step"] <= len(steps) and (row["step"] == 8) == (len(steps) == 8)
    best = json.loads(open(f"{ranked[0]['run_dir']}/summary.json").read())
    assert best["status"] == "finished" and best["workers"]["start"] == 2
    assert "optimizer.kwargs.lr" in format_ranking(ranked)
    with pytest.raises(ConfigError, match="field 'optimizer.kwargs'"):
        run_sweep(None, ["optimizer.kwargs.momentum=uniform(0.1, 0.9)"], 1, storage=tmp_path)
