"""``ringleader bench gpu``: its pure parts (the device's peak, the FLOPs per token, the size
that fits, the span timed), one clear line where there is no CUDA device, and a smoke run of
the whole bench on the CPU with a tiny GPT, so the code a GPU runs cannot rot in CI."""

from __future__ import annotations

import pytest

from benchmarks import gpu
from ringleader.cli import main
from tests.helpers.paths import REPO


@pytest.mark.parametrize(
    "name, peak",
    [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
     ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12), ("NVIDIA L40", 181e12), ("Tesla T4", None)],
)
def test_the_peak_is_looked_up_by_device_name(name, peak):
    assert gpu.peak_flops(name) == peak


def test_flops_per_token_are_6n_plus_the_attention_term():
    # GPT-2 small's layout: 12 layers of width 768 over 1024 tokens.
    assert gpu.flops_per_token(85_000_000, gpu.SIZES[-1][0]) == 6 * 85e6 + 12 * 12 * 768 * 1024


def test_the_largest_layout_that_fits_is_chosen():
    assert gpu.choose_size(80 * gpu.GIB).name == "gpt2-large"
    assert gpu.choose_size(40 * gpu.GIB).name == "gpt2-medium"
    assert gpu.choose_size(16 * gpu.GIB).name == gpu.choose_size(0).name == "gpt2"


def test_the_timed_span_starts_after_a_run_ahead_batch():
    # Steps 0-3 committed in one batch at t=1, 4-7 at t=2, 8-9 at t=3: timing from step 1's
    # completion would count steps 2 and 3 as done in the span.
    ends = [1.0, 1.0005, 1.001, 1.0015, 2.0, 2.0005, 2.001, 2.0015, 3.0, 3.0005]
    assert gpu.steady_span(ends, warmup=2) == (6, 3.0005 - 1.0015)
    with pytest.raises(ValueError, match="need at least 12 steps"):
        gpu.steady_span(ends, warmup=10)


def test_without_cuda_it_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    assert main(["bench", "gpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]


def test_the_device_script_parses_and_runs_what_exists():
    """deploy/gpu-check.sh: valid bash, a usage line for a wrong mode, and the suite's files and
    the bench's subcommand it runs are there."""
    import subprocess

    script = REPO / "deploy" / "gpu-check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    wrong = subprocess.run(["bash", str(script), "nonsense"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and wrong.stderr.startswith("usage:")
    text = script.read_text()
    for name in ("tests/gpu/test_gpu_worker.py", "tests/gpu/test_gpu_jobs.py"):
        assert name in text and (script.parents[1] / name).is_file()
    assert "-m ringleader bench gpu" in text
