"""The GPU suite's whole jobs, on Ray: the GPT recipe on one CUDA worker against the same job on
the CPU (fp32, within a stated tolerance) and in bf16; three workers sharing one GPU over gloo
through a SIGKILL, ending where one worker does; the fp16 loss scaler skipping the same steps
on every rank; a checkpoint written on one device and resumed on the other.

Every test runs on ``cpu`` (CI: the logic) and on ``cuda`` (``pytest -m gpu``, skipped saying
so where there is no CUDA device). Each asserts its workers ran on the device it names
(``workers_ready``). Measured differences go to the test's ``record_property`` (JUnit XML:
``deploy/gpu-check.sh`` keeps them), so the first run on a GPU shows how much of each
tolerance it used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobspec.step_record import read_telemetry

pytest.importorskip("ray", reason="the GPU suite's whole jobs need Ray (tests/gpu/test_gpu_worker.py does not)")

from orchestrator.job.reading import load_job  # noqa: E402 - after the skip: these import Ray
from orchestrator.launch import run_job  # noqa: E402
from tests.helpers.devices import DEVICES, worker_resources  # noqa: E402
from tests.helpers.jobs import assert_same_params, jsonl, params, run  # noqa: E402
from tests.helpers.paths import REPO

pytestmark = pytest.mark.usefixtures("ray_cluster")

GPT_YAML = REPO / "examples" / "gpt.yaml"
# examples/gpt.yaml's recipe (AdamW, warmup-cosine, clipping, causal_lm), made small.
TINY_GPT = (
    "model.kwargs={vocab_size: 256, block_size: 64, n_layer: 2, n_head: 2, n_embd: 64}",
    "dataset.kwargs={split: train, block_size: 64}",
    "eval=null", "steps=8", "batch_size=16", "shards=4", "checkpoint.every_steps=0",
    "schedule={name: warmup_cosine, warmup_steps: 2, min_lr_ratio: 0.1}",
)
# fp32 on CUDA against the CPU. No TF32 (torch's default for matmuls is full fp32), so the
# two differ only in the order of float sums (cuBLAS vs the CPU's GEMM, fused kernels):
# ~1e-6 relative per operation, which AdamW's normalised update can grow to a few 1e-5 of a
# parameter over 8 steps of lr 2e-3. Stated before any GPU run (none lent yet): the first run
# records how much of it the device used (record_property: max_param_diff, max_loss_rel_diff).
FP32_LOSS_RTOL = 1e-4
FP32_PARAM_ATOL = 1e-3
FP32_PARAM_RTOL = 1e-3
# bf16 autocast against fp32: each matmul rounds to 8 bits of mantissa; the loss curve agrees
# to a few percent (tests/ray_jobs/test_own_job.py holds bf16 parameters to rtol 2e-2).
BF16_LOSS_RTOL = 5e-2
# A checkpoint written on one device and resumed on the other: the first part's steps ran in
# one float order and the rest in another, so the resumed run matches the clean CPU run as
# fp32 on the two devices match (above), not bit for bit as on one device.
CROSS_DEVICE_RTOL = 1e-3
CROSS_DEVICE_ATOL = 1e-4


def _kill(at_step: int, worker: int) -> str:
    return f"chaos.kill=[{{at_step: {at_step}, worker: {worker}, how: sigkill}}]"


def _shared(device: str, workers: int) -> tuple[str, ...]:
    """``workers`` workers on ``device``; on CUDA all share the one GPU, so the collective must be
    gloo's (NCCL refuses two ranks on one device). Native all-reduce: gloo has no point-to-point
    for CUDA tensors, which our ring algorithms and the link probe use."""
    backend = ("collective.backend=gloo",) if device == "cuda" else ()
    return (_workers(workers), worker_resources(device, share=3), "collective.algorithm=native", *backend)


def _workers(count: int) -> str:
    """Exactly ``count`` workers (the examples let the group grow to theirs)."""
    return f"scaling={{workers: {count}, min_workers: 1, max_workers: {count}}}"


def _ran_on(run_dir: Path, device: str) -> None:
    """Every worker that started in the run dir's latest job (a resume appends one) reported
    ``device`` (``cuda`` is any ``cuda:N``)."""
    events = jsonl(run_dir / "events.jsonl")
    latest = max(i for i, e in enumerate(events) if e["event"] == "job_start")
    ready = [e for e in events[latest:] if e["event"] == "workers_ready"]
    assert ready and {w["device"].split(":")[0] for e in ready for w in e["workers"]} == {device}


def _steps(run_dir: Path) -> dict[int, dict]:
    return {e["step"]: e for e in jsonl(run_dir / "events.jsonl") if e["event"] == "step"}


def _run_gpt(tmp_path: Path, name: str, device: str, *overrides: str):
    job = load_job(GPT_YAML, [*TINY_GPT, _workers(1), worker_resources(device), *overrides])
    result = run_job(job, run_dir=tmp_path / name)
    assert result.summary["status"] == "finished", result.summary.get("error")
    _ran_on(result.run_dir, device)
    return result


@pytest.fixture(scope="module")
def gpt_on_cpu(tmp_path_factory, ray_cluster):
    """The tiny GPT recipe in fp32 on one CPU worker: what the device runs are held to."""
    return _run_gpt(tmp_path_factory.mktemp("gpt-cpu"), "fp32", "cpu", "precision=fp32")


def _max_rel(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


@pytest.mark.parametrize("device", DEVICES)
def test_the_gpt_recipe_on_the_device_matches_the_cpu_in_fp32(tmp_path, gpt_on_cpu, device, record_property):
    ours = _run_gpt(tmp_path, "fp32", device, "precision=fp32")
    got, want = _steps(ours.run_dir), _steps(gpt_on_cpu.run_dir)
    assert sorted(got) == sorted(want) == list(range(8))
    losses = [got[s]["loss"] for s in sorted(got)], [want[s]["loss"] for s in sorted(want)]
    record_property("max_loss_rel_diff", _max_rel(*losses))
    assert _max_rel(*losses) <= FP32_LOSS_RTOL
    mine, theirs = params(ours.run_dir), params(gpt_on_cpu.run_dir)
    record_property("max_param_diff", max(float((mine[k] - theirs[k]).abs().max()) for k in theirs))
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=FP32_PARAM_RTOL, atol=FP32_PARAM_ATOL, msg=key)


@pytest.mark.cpu_bf16_attention
@pytest.mark.parametrize("device", DEVICES)
def test_the_gpt_recipe_trains_in_bf16_on_the_device(tmp_path, gpt_on_cpu, device, record_property):
    ours = _run_gpt(tmp_path, "bf16", device, "precision=bf16")
    losses = [e["loss"] for _, e in sorted(_steps(ours.run_dir).items())]
    fp32 = [e["loss"] for _, e in sorted(_steps(gpt_on_cpu.run_dir).items())]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    record_property("max_loss_rel_diff_vs_fp32", _max_rel(losses, fp32))
    assert _max_rel(losses, fp32) <= BF16_LOSS_RTOL


@pytest.mark.parametrize("device", DEVICES)
def test_three_workers_sharing_the_device_end_a_sigkill_where_one_worker_does(tmp_path, device, record_property, one_worker):
    """In-place recovery with the replicas' state in device memory: a rank SIGKILLed at step 5,
    the survivors re-form over gloo and take the state from a live peer; every shard still
    counts once, so the parameters are one worker's (to float order, as on the CPU: the
    yardstick is the one worker's run re-ordered on the same device)."""
    want = one_worker(*_shared(device, 1))
    _ran_on(want.run_dir, device)
    killed = run(tmp_path, "three", *_shared(device, 3), _kill(5, 1))
    _ran_on(killed.run_dir, device)
    assert killed.summary["events"]["failures"] == 1 and killed.summary["events"]["recoveries"] == 1
    got = params(killed.run_dir)
    record_property("max_param_diff", max(float((got[k] - want[k]).abs().max()) for k in want))
    record_property("yardsticks", assert_same_params(got, want, f"3 workers sharing {device} through a SIGKILL") / want.yardstick.value)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_skips_the_same_steps_on_every_rank_sharing_the_device(tmp_path, device):
    """Sample 7 of the overflow dataset overflows fp16 at a scale of 1024: every rank skips each
    step holding it, decided from the same reduced gradient, and no other step."""
    h = "tests.helpers.losses"
    result = run(
        tmp_path, "fp16", *_shared(device, 3), f"model={{factory: '{h}:make_regressor'}}",
        f"dataset={{factory: '{h}:make_overflow_dataset'}}", "loss=mse", "precision=fp16",
        "loss_scaling={init: 1024, growth_interval: 1000}", "batch_size=32", "shards=4", "steps=20",
    )
    _ran_on(result.run_dir, device)
    skipped = {s for s, e in _steps(result.run_dir).items() if e.get("skipped")}
    assert skipped  # the hot sample was in some step
    records = read_telemetry(result.run_dir / "telemetry.jsonl")
    assert {r["rank"] for r in records} == {0, 1, 2}
    assert all(r["skipped"] == (r["step"] in skipped) for r in records)  # every rank alike


@pytest.mark.parametrize(
    "first, then",
    [
        pytest.param("cpu", "cpu", id="cpu-cpu"),
        pytest.param("cuda", "cpu", id="cuda-cpu", marks=pytest.mark.gpu),
        pytest.param("cpu", "cuda", id="cpu-cuda", marks=pytest.mark.gpu),
    ],
)
def test_a_checkpoint_written_on_one_device_resumes_on_the_other(tmp_path, reference, first, then, record_property):
    """12 steps on ``first`` with checkpoints, resumed to 25 on ``then``: the state crosses
    devices through the checkpoint and the run ends where a clean CPU run does (exactly when
    both parts ran on the CPU)."""
    job = (_workers(1), "checkpoint.every_steps=6")  # one worker: one GPU
    written = run(tmp_path, "run", "steps=12", *job, worker_resources(first))
    _ran_on(written.run_dir, first)
    resumed = run(tmp_path, "run", "steps=25", *job, worker_resources(then))
    _ran_on(resumed.run_dir, then)
    assert [e["checkpoint"] for e in jsonl(resumed.run_dir / "events.jsonl") if e["event"] == "resume"] == ["step-00000012"]
    got = params(resumed.run_dir)
    record_property("max_param_diff", max(float((got[k] - reference[k]).abs().max()) for k in reference))
    if first == then == "cpu":
        assert_same_params(got, reference, "resumed on the cpu")
        return
    for key in reference:
        torch.testing.assert_close(got[key], reference[key], rtol=CROSS_DEVICE_RTOL, atol=CROSS_DEVICE_ATOL, msg=key)
