"""One local Ray cluster for the whole test session, isolated from anything else on the machine,
and the tiers' folders kept honest.

The tests live in one folder per tier (docs/architecture.md, "Where it is tested"): ``pure/``
(one process: policies, math, plans, the controller over the fake group, files), ``multiprocess/``
(real processes, process groups or servers, gloo or the fake NCCL group; no Ray),
``ray_jobs/`` (a Ray cluster, this session's or ``cluster_utils.Cluster``, or whole jobs) and
``gpu/`` (a CUDA device)."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

if TYPE_CHECKING:
    from tests.helpers.jobs import Reference


def pytest_configure(config: pytest.Config) -> None:
    """Compiled kernels (``model.compile`` tests) go to a cache of this session's own unless
    TORCHINDUCTOR_CACHE_DIR says where: torch's cache key misses ``ATEN_CPU_CAPABILITY``, and
    kernels cached under another capability gave NaN (``avx2`` after AVX512) or failed to
    compile (``default``) here. Set before any test or Ray worker starts, so they inherit it."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        cache = tempfile.mkdtemp(prefix="rl-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache

        def remove() -> None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            shutil.rmtree(cache, ignore_errors=True)

        config.add_cleanup(remove)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A fresh local Ray (never an existing one) in its own temp dir and HOME.

    HOME is private so Ray's token auth (on by default in 2.60) writes its token there,
    not into the user's ~/.ray; RAY_TMPDIR is short because Ray's socket paths must be.
    """
    import ray

    scratch = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_TMPDIR")}
    os.environ["HOME"] = os.path.join(scratch, "home")
    os.environ["RAY_TMPDIR"] = os.path.join(scratch, "ray")
    os.makedirs(os.environ["HOME"])
    os.makedirs(os.environ["RAY_TMPDIR"])
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def private_ray_home(tmp_path, monkeypatch):
    """For tests whose subprocesses start their own Ray: ``tests.helpers.ray_home.private_ray_home``
    for the test (HOME ``tmp_path / "home"``)."""
    from tests.helpers.ray_home import private_ray_home as isolated

    with isolated(tmp_path / "home", monkeypatch):
        yield


@pytest.fixture(scope="session")
def one_worker(tmp_path_factory, ray_cluster) -> Callable[..., Reference]:
    """``one_worker(*overrides)``: the clean single-worker run of ``tests.helpers.jobs.run``'s
    job with ``overrides``, with the job's yardstick (``reference_run``: two runs). Run once a
    session for each ``overrides`` (the runs are deterministic, and tests only read them)."""
    from tests.helpers.jobs import reference_run

    done: dict[tuple[str, ...], Reference] = {}

    def reference_of(*overrides: str) -> Reference:
        if overrides not in done:
            done[overrides] = reference_run(tmp_path_factory.mktemp("ref"), *overrides)
        return done[overrides]

    return reference_of


@pytest.fixture(scope="session")
def reference(tmp_path_factory, one_worker) -> Reference:
    """The built-in job's one-worker run (``one_worker()``), which every run of it must match
    whatever happened to its workers; many modules compare against it. Its control is checked
    here, once: the same job with another seed ends far outside the bound."""
    from tests.helpers.jobs import assert_control_differs, params, run

    ran = one_worker()
    other_seed = run(tmp_path_factory.mktemp("control"), "seed1", "scaling.workers=1", "seed=1")
    assert_control_differs(params(other_seed.run_dir), ran, "the built-in job with seed 1")
    return ran


#: The fixtures that start Ray, which only ``ray_jobs/`` and ``gpu/`` may use.
RAY_FIXTURES = frozenset({"ray_cluster", "one_worker", "reference"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse to run a test filed in ``pure/`` or ``multiprocess/`` that asks for a fixture that
    starts Ray (``RAY_FIXTURES``, directly or through another fixture): its tier is what a
    reader (and ``pytest tests/pure``) trusts it to cost. A test that starts Ray by other means
    (``run_job`` itself) is not seen here; the review of a new test is."""
    misfiled = [
        item.nodeid for item in items
        if item.path.parent.name in ("pure", "multiprocess") and RAY_FIXTURES & set(getattr(item, "fixturenames", ()))
    ]
    if misfiled:
        raise pytest.UsageError(f"these tests start Ray, so they belong in tests/ray_jobs/: {', '.join(misfiled)}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``gpu`` is skipped, saying why, where torch sees no CUDA device (CI); one
    marked ``cpu_bf16_attention`` (its ``device`` parameter, if any, ``cpu``), where torch
    cannot run bf16 attention on this CPU."""
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
    on_cpu = getattr(item, "callspec", None) is None or item.callspec.params.get("device", "cpu") == "cpu"
    if on_cpu and item.get_closest_marker("cpu_bf16_attention") is not None:
        failure = cpu_bf16_attention_failure()
        if failure is not None:
            pytest.skip(failure)


@functools.cache
def cpu_bf16_attention_failure() -> str | None:
    """Why torch cannot run bf16 scaled-dot-product attention on this CPU under a forced
    ``ATEN_CPU_CAPABILITY``, or None (it can, or the capability is the CPU's own).

    Known case: ``ATEN_CPU_CAPABILITY`` forced below an AVX512 CPU's (``avx2``, ``default``).
    Torch's CPU flash attention picks its AVX512 VNNI packing from the hardware, but the kernel
    it then calls was built for the forced capability, and it raises "pack_vnni2 is only
    supported when avx512 is supported". (A CPU that truly lacks AVX512 should take the other
    path: not checked, no such machine here.) Under the CPU's own capability nothing is
    skipped. The probe uses the GPT recipe's head size (32) and a window long enough to take that path."""
    import torch

    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability is None:
        return None  # the CPU's own kernels: a failure there is a failure, never a skip
    query = torch.zeros(1, 1, 64, 32, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(query, query, query, is_causal=True)
    except RuntimeError as error:
        return f"torch cannot run bf16 attention on this CPU (ATEN_CPU_CAPABILITY={capability}): {error}"
    return None
