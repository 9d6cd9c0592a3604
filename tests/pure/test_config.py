"""Job files: defaults, overrides, and clear errors (exit 2, field named, no traceback)."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jobspec.chaos import KillChaos, SlowChaos, StallChaos
from jobspec.fields import ConfigError
from jobspec.job import JobConfig
from orchestrator.job.reading import load_job
from ringleader.cli import main
from tests.helpers.bad_jobs import BAD_JOBS, DEEP_BAD_JOBS, assert_refused, write_job
from tests.helpers.paths import REPO


def test_builtin_example_is_examples_digits_yaml():
    assert load_job(None) == load_job(REPO / "examples" / "digits.yaml")


@pytest.mark.parametrize("name", ["digits.yaml", "tinylm.yaml"])
def test_shipped_examples_validate(name):
    job = load_job(REPO / "examples" / name)
    assert job.name == Path(name).stem


def test_max_workers_follows_workers_unless_given():
    assert load_job(None, ["scaling.workers=8"]).scaling.max_workers == 8
    assert load_job(None, ["scaling={workers: 2, max_workers: 3}"]).scaling.max_workers == 3


def test_overrides_set_nested_fields():
    job = load_job(None, ["steps=50", "scaling.workers=3", "optimizer.kwargs.lr=0.5", "eval=null"])
    assert job.steps == 50 and job.scaling.workers == 3
    assert job.optimizer.kwargs == {"lr": 0.5} and job.eval is None


def test_an_override_inside_a_default_section_keeps_the_rest_of_it():
    """``--set dataset.shuffle=...`` changes the built-in dataset; naming another factory starts
    a dataset from nothing (the built-in's kwargs are not the new factory's)."""
    job = load_job(None, ["dataset.shuffle=permutation", "eval.batch_size=64"])
    assert job.dataset == JobConfig().dataset.model_copy(update={"shuffle": "permutation"})
    assert job.eval == JobConfig().eval.model_copy(update={"batch_size": 64})
    other = load_job(None, ["dataset.factory=tests.helpers.factories:make_broken_dataset"], resolve=False)
    assert other.dataset.kwargs == {}
    whole = load_job(None, ["dataset={factory: tests.helpers.factories:make_broken_dataset}", "dataset.shuffle=permutation"])
    assert whole.dataset.kwargs == {} and whole.dataset.shuffle == "permutation"


def test_epochs_instead_of_steps():
    job = load_job(None, ["steps=null", "epochs=2.5"])
    assert job.steps is None and job.epochs == 2.5


@pytest.mark.parametrize("mapping, expected", BAD_JOBS, ids=[e for _, e in BAD_JOBS])
def test_bad_job_file_exits_2_naming_the_field(tmp_path, capsys, mapping, expected):
    assert_refused(tmp_path, capsys, mapping, expected)


@pytest.mark.parametrize("mapping, expected", BAD_JOBS + DEEP_BAD_JOBS, ids=[e for _, e in BAD_JOBS + DEEP_BAD_JOBS])
def test_load_job_resolves_by_default(tmp_path, mapping, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_job(write_job(tmp_path, mapping))


def test_light_validation_imports_no_torch():
    # The launch path relies on it: torch loads in a thread while Ray starts.
    code = (
        "import sys; from orchestrator.job.reading import load_job; "
        "load_job(None, resolve=False); import orchestrator.launch; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--set", "steps"], "expected FIELD=VALUE"),
        (["--set", "scaling.workers=[1"], "not valid YAML"),
        (["--workers", "0"], "'scaling.workers'"),
    ],
)
def test_bad_overrides_exit_2(tmp_path, capsys, args, expected):
    assert main(["run", *args, "--run-dir", str(tmp_path / "run")]) == 2
    assert expected in capsys.readouterr().err


def test_override_through_a_scalar_names_it(tmp_path, capsys):
    path = write_job(tmp_path, {"scaling": {"workers": 2}})
    assert main(["run", path, "--set", "scaling.workers.x=1"]) == 2
    assert "field 'scaling.workers' is not a mapping" in capsys.readouterr().err


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read job file"):
        load_job(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_job(listing)


def test_non_empty_run_dir_is_refused_before_starting(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("precious")
    assert main(["run", "--run-dir", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("module", ["ringleader", "orchestrator.cli"])
def test_console_entry_point_exit_code_and_no_traceback(tmp_path, module):
    # orchestrator.cli is the old entrypoint of jobs submitted by hand: it still runs the
    # command, saying it is deprecated.
    path = write_job(tmp_path, {"scaling": {"workers": "two"}})
    proc = subprocess.run([sys.executable, "-m", module, "run", path], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "field 'scaling.workers'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert ("'python -m orchestrator.cli' is deprecated" in proc.stderr) == (module == "orchestrator.cli")


def test_jobconfig_is_immutable():
    with pytest.raises(Exception):
        JobConfig().steps = 3


# Chaos entries name their target by worker id ('worker'); 'rank' is its deprecated old name.

CHAOS_ENTRIES = {
    "slow": (SlowChaos, "{%s: 1, factor: 2}"),
    "stall": (StallChaos, "{%s: 1, at_step: 3, seconds: 1}"),
    "kill": (KillChaos, "{at_step: 3, %s: 1}"),
}


@pytest.mark.parametrize("kind", sorted(CHAOS_ENTRIES))
def test_chaos_entry_targets_a_worker(kind, recwarn):
    _, entry = CHAOS_ENTRIES[kind]
    job = load_job(None, [f"chaos.{kind}=[{entry % 'worker'}]"], resolve=False)
    assert getattr(job.chaos, kind)[0].worker == 1
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("kind", sorted(CHAOS_ENTRIES))
def test_chaos_rank_is_deprecated_name_of_worker(kind):
    model, entry = CHAOS_ENTRIES[kind]
    expected = f"chaos.{kind}: 'rank' is deprecated, use 'worker' (the worker id: its rank at job start)"
    with pytest.warns(FutureWarning, match=re.escape(expected)):
        job = load_job(None, [f"chaos.{kind}=[{entry % 'rank'}]"], resolve=False)
    parsed = getattr(job.chaos, kind)[0]
    assert isinstance(parsed, model) and parsed.worker == 1 and "rank" not in type(parsed).model_fields
    # A job saved after loading (checkpoints keep it) has the new name only.
    assert "rank" not in parsed.model_dump() and parsed.model_dump()["worker"] == 1


@pytest.mark.parametrize("kind", sorted(CHAOS_ENTRIES))
def test_chaos_rank_and_worker_together_are_refused(kind):
    _, entry = CHAOS_ENTRIES[kind]
    both = entry % "worker: 1, rank"
    with pytest.raises(ConfigError, match=re.escape(f"field 'chaos.{kind}.0': chaos.{kind}: set 'worker' only")):
        load_job(None, [f"chaos.{kind}=[{both}]"], resolve=False)


def test_chaos_rank_out_of_range_names_the_worker_field():
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match=re.escape("chaos.slow.0.worker: 9 is not a worker")):
        load_job(None, ["chaos.slow=[{rank: 9, factor: 2}]"], resolve=False)


def test_callables_are_recorded_by_a_name_that_imports_them_back_or_marked_not_importable():
    import functools
    import json

    from jobspec.fields import callable_name
    from tests.helpers.losses import make_model, token_loss

    assert callable_name(token_loss) == "tests.helpers.losses:token_loss"
    for unimportable in (lambda m, b: 0, functools.partial(make_model, 8)):
        assert callable_name(unimportable).startswith("<not importable: ")
    job = JobConfig.model_validate(
        {"model": {"factory": make_model, "kwargs": {"activation": json.dumps, "width": 8, "marker": object()}}}
    )
    dumped = job.model_dump(mode="json")["model"]
    assert dumped["factory"] == "tests.helpers.losses:make_model"
    assert dumped["kwargs"]["activation"] == "json:dumps" and dumped["kwargs"]["width"] == 8
    assert dumped["kwargs"]["marker"].startswith("<object object at")
    with pytest.raises(ConfigError, match="field 'model.factory'"):
        load_job(None, [f"model={{factory: '{callable_name(lambda: 0)}'}}"])


def test_the_job_file_reference_is_generated_from_the_models_and_current():
    from orchestrator.job.reference import reference

    text = reference()
    on_disk = (REPO / "docs" / "job-file.md").read_text()
    assert on_disk == text, "docs/job-file.md is stale: python -m orchestrator.job.reference > docs/job-file.md"
    for dotted in ("optimizer.clip_grad_norm", "worker.max_samples_per_pass", "chaos.kill[].during", "eval.metrics"):
        assert f"| `{dotted}` |" in text


@pytest.mark.parametrize("call", ["run", "resume"])
def test_the_api_takes_address_third_and_refuses_unknown_keywords(tmp_path, call):
    # Refused before anything starts: a misspelt option must not quietly run something else.
    import inspect

    import ringleader

    function = getattr(ringleader, call)
    assert list(inspect.signature(function).parameters)[2] == "address"
    first = {} if call == "run" else str(tmp_path)
    with pytest.raises(TypeError, match="unexpected keyword argument 'local_node'"):
        function(first, tmp_path / "never", local_node=2)
    assert not (tmp_path / "never").exists()


def test_the_old_entry_points_still_work_and_say_where_things_went():
    import orchestrator.cli
    import orchestrator.config

    with pytest.warns(FutureWarning, match="import JobConfig from jobspec.job"):
        assert orchestrator.config.JobConfig is JobConfig
    with pytest.warns(FutureWarning, match="import KillChaos from jobspec.chaos"):
        assert orchestrator.config.KillChaos is KillChaos
    with pytest.raises(AttributeError):
        orchestrator.config.NoSuchThing  # noqa: B018
    # The interpreter's own options go along to python -m ringleader.
    orig = ["python", "-X", "dev", "-u", "-m", "orchestrator.cli", "run", "-m", "x"]
    assert orchestrator.cli.interpreter_options(orig) == ["-X", "dev", "-u"]
    assert orchestrator.cli.interpreter_options(["python", "script.py"]) == []


def test_every_public_name_of_ringleader_loads_on_first_use():
    import ringleader

    assert sorted(ringleader.__all__) == sorted(ringleader._HOMES)  # the two lists name the same things
    for name in ringleader.__all__:
        assert getattr(ringleader, name) is getattr(importlib.import_module(ringleader._HOMES[name]), name)
