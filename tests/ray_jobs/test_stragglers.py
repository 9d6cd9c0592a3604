"""Straggler handling in whole jobs: injected slowness is detected and mitigated, and the
trajectory still equals a clean single-worker run with every shard committed once."""

from __future__ import annotations

import random

import pytest

from jobspec.step_record import read_telemetry
from tests.helpers.jobs import assert_same_params, jsonl, params, run

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _random_slowness(seed: int, workers: int, steps: int, spells: int = 8) -> str:
    """A seeded schedule of ``spells`` slow spells (random worker, factor, window) and short stalls."""
    rng = random.Random(seed)
    slow = []
    for _ in range(spells):
        start = rng.randrange(steps - 2)
        slow.append(f"{{worker: {rng.randrange(workers)}, factor: {rng.choice([2, 4, 8])}, "
                    f"from_step: {start}, to_step: {start + rng.randint(1, 4)}}}")
    stall = [f"{{worker: {rng.randrange(workers)}, at_step: {rng.randrange(steps)}, seconds: 0.3}}" for _ in range(2)]
    return f"chaos={{slow: [{', '.join(slow)}], stall: [{', '.join(stall)}]}}"


def test_stealing_and_backups_under_random_slowness_keep_every_shard_once(tmp_path, reference):
    result = run(
        # Enough slow spells that backups run and win in every run, however the timing falls
        # (with 8, a run now and then had one win, or none).
        tmp_path, "chaos", "scaling.workers=4", _random_slowness(seed=5, workers=4, steps=25, spells=14),
        # Quick to suspect and quick to call a shard late, so stealing and backups race a lot.
        "stragglers.late_factor=1.2", "stragglers.min_ratio=1.2", "stragglers.persistent_steps=1", "stragglers.window=2",
        "stragglers.evict=false",
    )
    assert_same_params(params(result.run_dir), reference, "chaos")
    events = result.summary["events"]
    assert events["stragglers_detected"] > 0 and events["stolen_shards"] > 0 and events["speculative_shards"] > 0, events
    telemetry = read_telemetry(result.run_dir / "telemetry.jsonl")
    for step in range(25):  # census: every shard of every step committed by exactly one worker
        committed = sorted(s for r in telemetry if r["step"] == step for s in r["shards"])
        assert committed == list(range(16)), (step, committed)
    assert sum(r["stolen"] for r in telemetry) == events["stolen_shards"]
    assert sum(r["backups_won"] for r in telemetry) == events["speculative_won"] > 0
    # Owners that lost a race took the shard's gradient back out (and the result still matches).
    assert sum(r["races_lost"] for r in telemetry) > 0
    logged = [e for e in jsonl(result.run_dir / "events.jsonl") if e["event"] == "straggler"]
    assert logged and all("slowness" in e and "cutoff" in e for e in logged)


def test_a_stall_nobody_predicted_is_rescued_within_its_step(tmp_path, reference):
    stall_s = 20.0
    result = run(
        tmp_path, "rescue", "scaling.workers=4", f"chaos.stall=[{{worker: 2, at_step: 8, seconds: {stall_s}}}]",
        "stragglers.evict=false",
    )
    assert_same_params(params(result.run_dir), reference, "rescue")
    events = result.summary["events"]
    # Rescued by the watch of the waiting workers, after the all-reduce: had worker 2 been a
    # suspect, its shards would have been stolen inside the step and no rescue pass run.
    # (Other steps may see a rescue too: a worker merely slow to start on this busy machine.)
    rescues = [e for e in jsonl(result.run_dir / "events.jsonl") if e["event"] == "rescue"]
    assert events["rescues"] == len(rescues) and events["rescued_shards"] == sum(e["shards"] for e in rescues)
    (rescue,) = [e for e in rescues if e["step"] == 8]
    assert set(rescue["gave_up"]) == {"2"}
    telemetry = read_telemetry(result.run_dir / "telemetry.jsonl")
    step8 = {r["worker"]: r for r in telemetry if r["step"] == 8}
    assert max(r["step_s"] for r in step8.values()) < 0.1 * stall_s
    assert step8[2]["shards"] == [] and step8[2]["gave_up"] and step8[2]["stalled_s"] < 0.1 * stall_s
    assert sorted(s for r in step8.values() for s in r["shards"]) == list(range(16))
    assert rescue["shards"] == step8[0]["rescued"] > 0
    assert sum(r["stolen"] for r in step8.values()) == rescue["shards"]
    # Worker 2 found its shards taken and goes on: its next reads do not queue behind the
    # stalled one, and it runs its own shards again (a step where a busy machine made it
    # start late may be rescued too).
    later = [r for r in telemetry if r["worker"] == 2 and r["step"] > 8]
    assert all(r["stalled_s"] < 1 for r in later)
    assert sum(1 for r in later if r["shards"] and not r["gave_up"]) >= len(later) - 2
    assert result.summary["wall_s"] < stall_s


def test_random_stalls_are_rescued_and_the_counters_add_up(tmp_path, reference):
    seed, probability, stall_s = 3, 0.1, 2.0
    result = run(
        tmp_path, "stalls", "scaling.workers=4",
        f"chaos.stalls={{probability: {probability}, seconds: {stall_s}, seed: {seed}}}",
        # Every worker keeps shards (a worker with none has no data to wait for).
        "stragglers.rebalance=false", "stragglers.evict=false",
        # Claims spread over three store processes (ranks 0 and 3 on the first): rescues,
        # steals and backups move claims across them.
        "stragglers.claim_stores=3",
    )
    assert_same_params(params(result.run_dir), reference, "stalls")
    telemetry = read_telemetry(result.run_dir / "telemetry.jsonl")
    drawn = {(w, s) for w in range(4) for s in range(25) if random.Random(f"{seed}/{w}/{s}").random() < probability}
    # Each drawn stall was waited out in full (no expected time yet, or nobody to watch) or
    # given up; a long wait happened nowhere else. (A worker merely late may give up too.)
    waited = {(r["worker"], r["step"]) for r in telemetry if r["stalled_s"] > stall_s / 2}
    gave_up = {(r["worker"], r["step"]) for r in telemetry if r["gave_up"]}
    assert waited <= drawn <= waited | gave_up and gave_up
    steps = {s: [r for r in telemetry if r["step"] == s] for s in range(25)}
    for step, reports in steps.items():
        assert sorted(s for r in reports for s in r["shards"]) == list(range(16)), step
        if step >= 3 and any((r["worker"], step) in drawn for r in reports):
            assert max(r["step_s"] for r in reports) < stall_s / 2, (step, reports)
    events = result.summary["events"]
    assert events["rescues"] == sum(1 for reports in steps.values() if reports[0]["rescued"]) >= 1
    assert events["rescued_shards"] == sum(reports[0]["rescued"] for reports in steps.values())
    for counter, field in (("stolen_shards", "stolen"), ("speculative_shards", "backups"),
                           ("speculative_won", "backups_won"), ("races_lost", "races_lost")):
        assert events[counter] == sum(r[field] for r in telemetry), counter
    assert events["speculative_won"] <= events["speculative_shards"]
    # The workers' own counts against what they committed: with no rebalancing rank r's planned
    # shards are 4r..4r+3, so every shard committed by another rank was stolen (a rescue's
    # shards too) or won by a backup; a stolen shard can still be lost to a backup (a race).
    foreign = {s: sum(1 for r in reports for shard in r["shards"] if shard // 4 != r["rank"]) for s, reports in steps.items()}
    assert sum(foreign.values()) > 0
    for step, reports in steps.items():
        taken = sum(r["stolen"] + r["backups_won"] for r in reports)
        assert taken - sum(r["races_lost"] for r in reports) <= foreign[step] <= taken, (step, reports)


def test_a_persistently_slow_worker_gets_fewer_shards(tmp_path, reference):
    result = run(
        tmp_path, "rebalance", "scaling.workers=4", "steps=25",
        "chaos.slow=[{worker: 3, factor: 4}]", "stragglers.steal=false", "stragglers.speculate=false",
        # On this tiny model a pass is mostly overhead, so 4x slower stays late even with one
        # shard and would (rightly) be evicted; this test is about the split.
        "stragglers.evict=false",
    )
    assert_same_params(params(result.run_dir), reference, "rebalance")
    assert result.summary["events"]["rebalances"] >= 1
    assert result.summary["events"]["stolen_shards"] == 0
    last = [r for r in read_telemetry(result.run_dir / "telemetry.jsonl") if r["step"] == 24]
    counts = {r["worker"]: len(r["shards"]) for r in last}
    assert counts[3] < min(counts[w] for w in (0, 1, 2)), counts
    decisions = [e for e in jsonl(result.run_dir / "events.jsonl") if e["event"] == "rebalance"]
    assert decisions and "shard_s" in decisions[0] and "predicted_step_s" in decisions[0]


def test_without_mitigation_the_plan_is_kept(tmp_path):
    result = run(
        tmp_path, "off", "scaling.workers=2", "steps=8",
        "chaos.slow=[{worker: 1, factor: 3}]", "stragglers.mitigation=false",
    )
    events = result.summary["events"]
    assert events["stolen_shards"] == events["speculative_shards"] == events["rebalances"] == 0
    assert all(len(r["shards"]) == 8 for r in read_telemetry(result.run_dir / "telemetry.jsonl"))


def test_a_stalled_worker_is_removed_as_a_failure_and_the_job_finishes_without_waiting(tmp_path, reference):
    result = run(
        tmp_path, "stall", "scaling.workers=4",
        # Stalled after sealing its shards: nobody can take them, everyone waits for it.
        "chaos.stall=[{worker: 2, at_step: 6, seconds: 120, during: compute}]", "stragglers.silent_s=2",
    )
    assert_same_params(params(result.run_dir), reference, "stall")
    summary = result.summary
    # Silence is a failure: counted as one, and its slot stays for a replacement (which may
    # still be loading when this short job ends).
    assert summary["workers"]["start"] == 4 and summary["workers"]["end"] in (3, 4)
    assert summary["events"]["failures"] == 1 and summary["events"]["evictions"] == 0
    assert summary["events"]["steps_redone"] >= 1
    assert summary["wall_s"] < 60  # nowhere near the 120 s stall
    events = jsonl(result.run_dir / "events.jsonl")
    evicted = [e for e in events if e["event"] == "evict"]
    assert evicted[0]["worker"] == 2 and evicted[0]["reason"] == "silent"
    assert evicted[0]["evidence"]["progress"]["phase"] == "stall"
    assert {r["worker"] for r in read_telemetry(result.run_dir / "telemetry.jsonl") if r["step"] == 24} - {4} == {0, 1, 3}


def test_a_persistently_far_slower_worker_is_evicted_at_a_step_boundary(tmp_path, reference):
    result = run(
        tmp_path, "slow", "scaling.workers=3",
        "chaos.slow=[{worker: 1, factor: 30, from_step: 3}]",
        "stragglers.evict_ratio=5", "stragglers.persistent_steps=2", "stragglers.window=3",
    )
    assert_same_params(params(result.run_dir), reference, "slow")
    assert result.summary["workers"] == {"start": 3, "end": 2}
    events = result.summary["events"]
    assert events["evictions"] == 1 and events["steps_redone"] == 0  # drained, nothing aborted
    evicted = [e for e in jsonl(result.run_dir / "events.jsonl") if e["event"] == "evict"]
    assert evicted[0]["worker"] == 1 and evicted[0]["reason"] == "slow" and evicted[0]["evidence"]["ratio"] > 5
