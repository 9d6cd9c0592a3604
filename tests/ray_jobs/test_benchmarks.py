"""The benchmarks' runners: each produces a row, and all contenders (ours, Ray Train, Ray Train +
torchft, torchrun) train the same model to the same loss, which is what makes the comparison
fair."""

from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch

from benchmarks.collectives import MB, allreduce_rows, format_allreduce, overlap_result
from benchmarks.ray_head import STOP_TIMEOUT_S, start_head
from benchmarks.straggler import VARIANTS as STRAGGLER_VARIANTS
from benchmarks.straggler import StragglerChaos
from benchmarks.straggler import run_benchmark as run_straggler
from benchmarks.straggler import summarize as summarize_straggler
from benchmarks.straggler import variant_job as straggler_variant_job
from benchmarks.throughput import FRAMEWORKS, format_table, medians, run_once
from benchmarks.workloads import workload_job
from tests.helpers.ray_home import private_ray_home

#: The straggler benchmark's chaos below: every step of every worker stalls (for 4 clean steps).
ALL_STALL = StragglerChaos("stall", probability=1.0, stall_steps=4)


@pytest.fixture(scope="module")
def stalled_straggler_runs(tmp_path_factory):
    """The straggler benchmark under ``ALL_STALL`` (digits, 2 workers, 5 steps, one repeat):
    (clean step seconds, samples/s and rows by variant). Run once for the two tests below: it
    runs ringleader, Ray Train and torchft (each ~20 s of startup), which the runner test
    needs too."""
    home = tmp_path_factory.mktemp("straggler") / "home"
    with pytest.MonkeyPatch.context() as monkeypatch, private_ray_home(home, monkeypatch):
        return run_straggler(workload="digits", workers=2, steps=5, chaos=ALL_STALL, repeats=1, log=lambda line: None)


@pytest.mark.usefixtures("private_ray_home")
def test_each_runner_gives_a_row_and_all_reach_the_same_loss(stalled_straggler_runs, tmp_path):
    # ringleader cold, Ray Train and torchft ran in the straggler benchmark, on its job: ours
    # clean, the peers with every step stalled (a stall delays a step and changes no number, so
    # they still reach our loss). The runners it does not use run here on the same job.
    ran = stalled_straggler_runs[2]
    job = straggler_variant_job(workload_job("digits", workers=2, steps=5), "clean", {})[1]
    with contextlib.contextmanager(start_head)(tmp_path / "head") as head:  # what the attached run joins
        attached = run_once("ringleader_attached", job, tmp_path / "ringleader_attached", head)
        torchrun = run_once("torchrun", job, tmp_path / "torchrun")
        stopping = time.monotonic()
    # The head stops when told (it used to wait out Ray's 30 s drain on SIGTERM for a GCS that
    # the same signal had just stopped).
    assert time.monotonic() - stopping < STOP_TIMEOUT_S / 2
    rows = [ran["clean"][0], attached, ran["ray_train"][0], ran["torchft"][0], torchrun]
    assert [row.framework for row in rows] == list(FRAMEWORKS)
    for row in rows:
        assert row.first_step_s > 0 and row.step_s > 0 and row.samples_per_s > 0 and row.wall_s > row.first_step_s
        assert row.eval_loss is not None and math.isfinite(row.eval_loss)
    ours = rows[0].eval_loss
    for row in rows[1:]:
        assert row.eval_loss == pytest.approx(ours, rel=1e-4), f"{row.framework} trained a different model"
    table = medians(rows)
    assert set(table["digits"]) == set(FRAMEWORKS)
    assert "ours/ray_train" in format_table(table) and "attached to a running Ray" in format_table(table)


def test_allreduce_benchmark_rows_have_the_promised_fields():
    rows = allreduce_rows(workers=4, sizes_mb=[0.01, 0.1], nodes=2, iters=1)
    assert {r["algorithm"] for r in rows} == {"native", "ring", "hierarchical"}
    assert {r["size_bytes"] for r in rows} == {int(0.01 * MB) // 4 * 4, int(0.1 * MB) // 4 * 4}
    for row in rows:
        assert set(row) == {"algorithm", "workers", "nodes", "size_bytes", "time_s", "algbw_gbps", "busbw_gbps"}
        assert row["time_s"] > 0
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * 3 / 4)
    assert "vs native" in format_allreduce(rows)


def test_overlap_benchmark_reports_both_modes():
    job = workload_job("digits", workers=2, steps=8)
    job = job.model_copy(update={"model": job.model.model_copy(update={"kwargs": {"hidden": 64}})})
    # Small buckets (~1000 floats): several per step, so overlap launches some during backward.
    job = job.model_copy(update={"collective": job.collective.model_copy(update={"bucket_mb": 0.004})})
    result = overlap_result(job.model_dump_json(), workers=2, rounds=1, steps=4)
    assert set(result) == {"overlap", "no_overlap", "agreement"}
    for mode in ("overlap", "no_overlap"):
        assert result[mode]["step_s"] > 0 and result[mode]["exposed_comm_s"] >= 0
    # The two modes are the same training: overlap moves when buckets are reduced, not the result.
    assert result["agreement"]["max_param_diff"] <= 1e-6


def test_straggler_benchmark_injects_the_same_chaos_into_every_variant_that_has_it():
    base = workload_job("digits", 2, 5)
    for chaos, field in ((StragglerChaos("slow", factor=3.0), "slow"), (StragglerChaos("stall", probability=0.1), "stalls")):
        entries = chaos.entries(workers=2, step_s=0.05, shard_s=0.002)
        for variant in STRAGGLER_VARIANTS:
            framework, job = straggler_variant_job(base, variant, entries)
            chaotic = variant in ("unmitigated", "mitigated", "ray_train", "torchft")
            assert bool(getattr(job.chaos, field)) == chaotic
            assert job.stragglers.mitigation == (variant in ("clean", "mitigated"))
            assert framework == (variant if variant in ("ray_train", "torchft") else "ringleader")
    (slow,) = straggler_variant_job(base, "ray_train", StragglerChaos().entries(2, 0.05, 0.002))[1].chaos.slow
    assert slow.worker == 1 and slow.shard_s == 0.002  # the same sleep in both frameworks
    stalls = straggler_variant_job(base, "mitigated", StragglerChaos("stall", stall_steps=20).entries(2, 0.05, 0.002))[1].chaos.stalls
    assert stalls.seconds == pytest.approx(1.0) and stalls.probability == 0.02


def test_straggler_benchmark_runs_every_variant_with_the_stalls_in_both_frameworks(stalled_straggler_runs):
    # Every step of every worker stalls (ALL_STALL): nobody is left to rescue anyone, so each
    # chaotic variant, Ray Train's and torchft's included, must run far below clean.
    chaos = ALL_STALL
    step_s, rates, _ = stalled_straggler_runs
    assert step_s > 0
    assert set(rates) == set(STRAGGLER_VARIANTS) and all(len(r) == 1 and r[0] > 0 for r in rates.values())
    result = summarize_straggler(rates, workers=2, chaos=chaos)
    assert set(result["samples_per_s"]) == {"clean", "unmitigated", "mitigated", "ray_train", "torchft"}
    clean = result["samples_per_s"]["clean"]
    for variant in ("unmitigated", "mitigated", "ray_train", "torchft"):
        assert result["samples_per_s"][variant] < clean / 2, (variant, result)
    assert "hidden" in result and result["ideal"] == clean


@pytest.mark.usefixtures("private_ray_home")
def test_recovery_benchmark_our_side_loses_no_committed_step_and_no_sample(tmp_path):
    from benchmarks.recovery import against_clean, format_result, ours_recovery
    from benchmarks.throughput import model_file

    plain = workload_job("digits", workers=2, steps=16)
    plain = plain.model_copy(update={"scaling": plain.scaling.model_copy(update={"resources_per_worker": {"CPU": 0.5}})})
    # The survivor pauses the job in step 9 (after sealing its shards) for 15 s: time for a
    # replacement worker to start and join (max_workers 2), also on a busy machine.
    job = plain.model_copy(update={
        "chaos": plain.chaos.model_validate({"stall": [{"worker": 0, "at_step": 9, "seconds": 15, "during": "compute"}]}),
    })
    ours = ours_recovery(job, tmp_path / "killed", kill_step=5, kill_rank=1, checkpoint_every=4)
    assert ours["steps_lost"] == 0 and ours["steps_redone"] >= 1 and ours["samples_dropped"] == 0
    assert 0 < ours["recovery_s"] < ours["full_size_s"] < ours["wall_s"]
    assert set(ours["split_s"]) == {"detect_s", "reform_s", "transfer_s", "redo_s"}
    # Measured, not assumed: the killed run's final parameters against a clean run's (the stall
    # changes no number, so the clean run goes without it).
    exact = against_clean("ringleader", plain, tmp_path / "clean", ours, model_file("ringleader", tmp_path / "killed"), 5, 4)
    assert exact["exact"] and exact["max_param_diff"] < 1e-5 and exact["samples_dropped"] == 0, exact
    ours["exactness"] = exact
    theirs = {"recovery_s": 12.0, "full_size_s": 12.0, "steps_lost": 5, "samples_dropped": 0, "wall_s": 40.0,
              "exactness": exact}
    torchft = {**theirs, "recovery_s": 6.0, "full_size_s": None, "steps_lost": 0, "samples_dropped": 128,
               "exactness": {"max_param_diff": 1e-3, "exact": False}}
    setup = {"checkpoint_every": 4, "steps": 16, "kill_step": 5, "exact_steps": 16, "exact_kill_step": 5}
    text = format_result({"contenders": {"ringleader": ours, "ray_train": theirs, "torchft": torchft},
                          "checkpoint_overhead": 0.01, "checkpoint_overhead_spread": [-0.02, 0.03], "setup": setup,
                          "checkpoint_samples_per_s": {}, "checkpoint_snapshot_share": 0.001,
                          "checkpoint_write_cpu_s": 0.004, "checkpoint_outside_per_checkpoint_s": 0.012,
                          "checkpoint_step_s": {"none": 0.032, "every_4": 0.0335}})
    assert "recovery vs ours: ray_train" in text and "overhead +1.0%" in text and "spread -2.0% to +3.0%" in text
    assert "its write took 4.0 ms of CPU" in text
    assert "+12.0 ms outside steps per checkpoint" in text and "none 32.0 ms vs every_4 33.5 ms" in text
    torchft_line = next(line for line in text.splitlines() if line.startswith("torchft"))
    assert "never" in torchft_line and " 128 " in torchft_line and " no " in torchft_line


def test_the_parameter_comparison_sees_a_difference_and_refuses_another_model(tmp_path):
    from benchmarks.recovery import param_diff
    from benchmarks.throughput import BenchmarkError

    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}
    paths = [tmp_path / f"{name}.pt" for name in ("a", "b", "c", "d")]
    torch.save(state, paths[0])
    torch.save({k: v.clone() for k, v in state.items()}, paths[1])
    torch.save({**state, "b": torch.tensor([0.0, 1e-3, 0.0])}, paths[2])
    torch.save({"w": state["w"]}, paths[3])
    assert param_diff(paths[1], paths[0]) == (0.0, True)
    diff, exact = param_diff(paths[2], paths[0])
    assert diff == pytest.approx(1e-3) and not exact
    with pytest.raises(BenchmarkError, match="hold different parameters"):
        param_diff(paths[3], paths[0])


@pytest.mark.usefixtures("private_ray_home")
def test_checkpoint_overhead_runs_with_and_without_checkpoints(tmp_path):
    from benchmarks.recovery import checkpoint_overhead

    job = workload_job("digits", workers=1, steps=12)
    lines: list[str] = []
    result = checkpoint_overhead(job, tmp_path, every=4, repeats=1, log=lines.append)
    assert set(result["samples_per_s"]) == {"none", "every_4"} and all(v > 0 for v in result["samples_per_s"].values())
    # What each variant wrote, from its own summary: nothing, then a checkpoint every 4 steps.
    assert "(0 written;" in lines[0] and "(3 written;" in lines[1], lines
    assert result["overhead"] == pytest.approx(1 - result["samples_per_s"]["every_4"] / result["samples_per_s"]["none"])
    assert result["overhead_spread"] == [result["overhead"]] * 2  # one repeat: one paired figure
    assert 0 < result["snapshot_share"] < 0.5  # the snapshots' copies held training up, a little
    # Rank 0's telemetry: its steps, and the time between them (some, in any run).
    assert set(result["step_s"]) == {"none", "every_4"} and all(0 < v < 10 for v in result["step_s"].values())
    assert "outside steps" in lines[0] and "mean step" in lines[1]
    assert abs(result["outside_per_checkpoint_s"]) < 10


def test_control_plane_benchmark_measures_a_real_null_job_and_fits_the_growth(tmp_path):
    from benchmarks.control_plane import fit, format_report, measure, with_idle_taken_out

    # The 3-worker job's claims over two store processes (``--claim-stores``): both counted.
    rows = [measure(2, 12, tmp_path), measure(3, 12, tmp_path, claim_stores=2)]
    for row in rows:
        assert row["steps_measured"] >= 5
        assert row["driver_cpu_ms"] > 0 and 0 < row["driver_busy_ms"] <= row["step_wall_ms"]
        # Mitigation on, nobody slow: clean steps, which make no claims (the median step sends
        # the store nothing; before, each worker sealed its block and the driver opened the step).
        assert row["store_round_trips"] == row["store_bytes"] == 0
        assert "store_cpu_ms" in row  # its own process, read apart (tests/multiprocess/test_control_meter.py reads it)
    fitted = fit(rows)
    assert "store_cpu_ms" in fitted
    assert fitted["store_round_trips"]["at_4096"] == pytest.approx(0.0, abs=1e-9)
    assert "at 4096" in format_report(rows, fitted)
    # The fit itself: exact on a line, and it needs two worker counts.
    line = [{"workers": n, "driver_cpu_ms": 1 + 0.5 * n, "driver_busy_ms": 2.0, "store_round_trips": 3 * n,
             "store_bytes": 100.0 * n, "step_wall_ms": 10.0} for n in (4, 8, 16)]
    cpu = fit(line)["driver_cpu_ms"]
    assert cpu["fixed"] == pytest.approx(1.0) and cpu["per_worker"] == pytest.approx(0.5)
    assert cpu["at_4096"] == pytest.approx(1 + 0.5 * 4096)
    with pytest.raises(ValueError, match="two worker counts"):
        fit(line[:1])
    # An idle driver's CPU per second of wall, taken out of each row before the fit (on 2 cores
    # the step's wall grows with N), and put back for a 1 s step in the prediction.
    walled = [{**row, "step_wall_ms": 100.0 * row["workers"], "driver_cpu_ms": 1 + 0.5 * row["workers"] + 0.2 * row["workers"]}
              for row in line]
    with_idle_taken_out(walled, idle_ms_per_s=2.0)  # 2 ms/s x 0.1 N s = 0.2 N ms
    net = fit(walled)["driver_cpu_net_ms"]
    assert net["per_worker"] == pytest.approx(0.5) and net["fixed"] == pytest.approx(1.0)
    assert f"{1 + 0.5 * 4096 + 2.0:.1f} ms CPU at 4096" in format_report(walled, fit(walled), 2.0)


def test_the_synthetic_control_plane_runs_the_real_controller_over_thousands_of_ranks(tmp_path):
    from benchmarks.control_plane import control_plane_job
    from benchmarks.driver_scale import measure_synthetic
    from jobspec.step_record import read_telemetry

    row = measure_synthetic(control_plane_job(2048, 12), tmp_path)
    assert row["workers"] == 2048 and row["steps_measured"] >= 5 and row["steps_per_call"] > 1
    assert 0 < row["driver_cpu_ms"] < row["step_wall_ms"] and row["synthetic_build_ms"] > 0
    # The whole controller ran: every step committed with every rank's row, each shard once.
    telemetry = read_telemetry(tmp_path / "synthetic-2048" / "telemetry.jsonl")
    assert len(telemetry) == 12 * 2048
    assert sorted(s for r in telemetry if r["step"] == 11 for s in r["shards"]) == list(range(2048))
