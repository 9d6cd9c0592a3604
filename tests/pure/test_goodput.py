"""The goodput account (policies/goodput.py): pure arithmetic."""

import pytest

from policies.goodput import CAUSES, RecoverySpans, account


def test_lost_time_is_charged_by_cause_and_the_rest_is_productive():
    recovery = RecoverySpans(detect_s=1.0, reform_s=3.0, transfer_s=0.5, waited_s=2.0, redo_s=1.5)
    goodput = account(
        100.0, startup_s=10.0, checkpoint_stall_s=2.0, recoveries=[recovery, recovery],
        straggler_wait_s=4.0, finishing_s=3.0,
    )
    assert dict(goodput.lost_s) == {
        "startup": 10.0, "checkpoint_stalls": 2.0, "detection": 2.0, "reforming": 3.0,
        "waiting_for_workers": 4.0, "redone_steps": 3.0, "stragglers": 4.0, "finishing": 3.0,
    }
    assert tuple(goodput.lost_s) == CAUSES
    assert goodput.productive_s == pytest.approx(69.0) and goodput.share == pytest.approx(0.69)
    assert goodput.to_json()["goodput"] == pytest.approx(0.69)


def test_overlapping_spans_never_exceed_the_wall_time():
    goodput = account(10.0, startup_s=8.0, checkpoint_stall_s=5.0, recoveries=[], straggler_wait_s=3.0)
    assert goodput.lost_s["startup"] == 8.0 and goodput.lost_s["checkpoint_stalls"] == 2.0
    assert goodput.lost_s["stragglers"] == 0.0 and goodput.productive_s == 0.0 and goodput.share == 0.0
    assert account(0.0, startup_s=0.0, checkpoint_stall_s=0.0, recoveries=[], straggler_wait_s=0.0).share == 0.0


def test_a_negative_span_is_refused_by_name():
    with pytest.raises(ValueError, match="stragglers seconds must be >= 0"):
        account(1.0, startup_s=0.0, checkpoint_stall_s=0.0, recoveries=[], straggler_wait_s=-1.0)


def _report(compute_s: float, idle_s: float = 0.0, stalled_s: float = 0.0):
    from jobspec.wire import StepTelemetry

    return StepTelemetry(
        step=0, rank=0, worker=0, shards=(), samples=0, global_samples=0, loss=0.0,
        compute_s=compute_s, comm_s=0.0, optim_s=0.0, step_s=0.0, idle_s=idle_s, stalled_s=stalled_s,
    )


def test_straggler_wait_is_what_workers_waited_for_the_last_one():
    from jobspec.step_record import StepRecord
    from orchestrator.accounting.ledger import straggler_wait

    # Mitigation off: a worker 3x slower makes the two others wait 2 s each in the all-reduce.
    assert straggler_wait(StepRecord.of(0, [_report(1.0), _report(1.0), _report(3.0)])) == pytest.approx(4.0 / 3)
    # A stall of 5 s on one worker: the others wait for it.
    assert straggler_wait(StepRecord.of(0, [_report(1.0), _report(1.0, stalled_s=5.0)])) == pytest.approx(2.5)
    # Mitigation on: the fast worker took shards and sat idle 0.5 s at the end; arrivals equal.
    assert straggler_wait(StepRecord.of(0, [_report(1.5, idle_s=0.5), _report(2.0)])) == pytest.approx(0.25)
    assert straggler_wait(StepRecord.of(0, [_report(1.0), _report(1.0)])) == 0.0
