"""The deploy files stay in step with the code: they parse, and the commands they run are ones
ringleader accepts (a cluster is not needed to catch a renamed flag or field)."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib

import pytest
import yaml
from ray.runtime_env import RuntimeEnv

from orchestrator.job.reading import load_job
from ringleader.cli import _parser
from tests.helpers.paths import REPO

DEPLOY = REPO / "deploy"


def _job_from(argv: list[str]):
    """The job a ``ringleader run`` command line (after ``run``) would run."""
    args = _parser().parse_args(["run", *argv])
    overrides = list(args.overrides) + ([f"scaling.workers={args.workers}"] if args.workers else [])
    return load_job(DEPLOY.parent / args.job if args.job else None, overrides, resolve=False)


def test_cluster_yaml_names_its_node_types():
    cluster = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    assert cluster["head_node_type"] in cluster["available_node_types"]
    assert cluster["docker"]["image"].startswith("rayproject/ray:2.60.0")


def test_runtime_env_is_one_ray_accepts():
    env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    RuntimeEnv(**env)  # raises on unknown or malformed fields
    assert env["working_dir"] == "."


# What the cluster image (rayproject/ray) already has: Ray itself and its own dependencies.
IMAGE_PROVIDES = {"ray", "numpy", "pyarrow"}


def _runtime_envs() -> dict[str, dict]:
    rayjob = yaml.safe_load((DEPLOY / "k8s" / "rayjob.yaml").read_text())
    return {
        "runtime_env.yaml": yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text()),
        "k8s/rayjob.yaml": yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"]),
    }


@pytest.mark.parametrize("name", sorted(_runtime_envs()))
def test_runtime_env_installs_every_runtime_dependency(name):
    # The driver and the workers import these on the cluster: one missing from the list fails
    # a submitted job at import, which no local run shows.
    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]
    needed = {re.split(r"[<>=\[ ]", spec, maxsplit=1)[0].lower() for spec in project["dependencies"]}
    installed = {re.split(r"[<>=\[ ]", spec, maxsplit=1)[0].lower() for spec in _runtime_envs()[name]["pip"]}
    assert needed - IMAGE_PROVIDES <= installed, sorted(needed - IMAGE_PROVIDES - installed)


def test_submit_script_is_valid_bash_and_runs_the_cli():
    subprocess.run(["bash", "-n", str(DEPLOY / "submit.sh")], check=True)
    assert "python -m ringleader run" in (DEPLOY / "submit.sh").read_text()


def test_rayjob_entrypoint_is_a_valid_ringleader_run():
    rayjob = yaml.safe_load((DEPLOY / "k8s" / "rayjob.yaml").read_text())
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "ringleader", "run"]
    job = _job_from(argv[4:])
    assert job.checkpoint.enabled and job.checkpoint.path.startswith("s3://")
    RuntimeEnv(**yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"]))


def test_submit_quotes_every_value_before_it_reaches_the_heads_shell(tmp_path):
    """Ray runs the entrypoint in a shell on the head node: a value like `$(touch ...)` must
    arrive as text. The submission goes through Ray's real `ray job submit` command (only its
    HTTP client is replaced, to record the entrypoint it would send)."""
    import sys

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    recorded = tmp_path / "entrypoint"
    (fake_bin / "ray").write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "from ray.dashboard.modules.job import cli\n"
        "class Client:\n"
        "    def submit_job(self, entrypoint, **kwargs):\n"
        f"        open({str(recorded)!r}, 'w').write(entrypoint)\n"
        "        raise SystemExit(0)\n"
        "cli._get_sdk_client = lambda *args, **kwargs: Client()\n"
        "cli.job_cli_group.main(args=sys.argv[2:], prog_name='ray job')\n"
    )
    (fake_bin / "ray").chmod(0o755)
    marker = tmp_path / "pwned"
    evil = f"checkpoint.path=s3://b/$(touch {marker})"
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "RAY_ADDRESS": "http://127.0.0.1:1", "HOME": str(tmp_path)}
    subprocess.run(["bash", str(DEPLOY / "submit.sh"), "examples/digits.yaml", "--set", evil], check=True, env=env)
    entrypoint = recorded.read_text()  # what Ray hands the head node's shell
    assert shlex.split(entrypoint) == [
        "python", "-m", "ringleader", "run", "--no-progress", "examples/digits.yaml", "--set", evil,
    ]
    echoed = subprocess.run(["sh", "-c", f"printf '%s\\n' {entrypoint.split(' ', 4)[4]}"], capture_output=True, text=True)
    assert evil in echoed.stdout.splitlines() and not marker.exists()


def test_submit_refuses_a_credential_before_it_reaches_the_entrypoint(tmp_path):
    """What `ray job list` and the dashboard show must hold no secret: a value with one is
    refused (exit 2, one line, the secret masked) and Ray is never called."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    called = tmp_path / "ray-called"
    (fake_bin / "ray").write_text(f"#!/bin/sh\ntouch {called}\n")
    (fake_bin / "ray").chmod(0o755)
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "RAY_ADDRESS": "http://127.0.0.1:1", "HOME": str(tmp_path)}
    for value in ("checkpoint.path=s3://AKIAEXAMPLE:SECRETKEY@bucket/ckpt", "checkpoint.path=gs://b/c?access_token=SECRETKEY"):
        done = subprocess.run(
            ["bash", str(DEPLOY / "submit.sh"), "examples/digits.yaml", "--set", value], env=env, capture_output=True, text=True
        )
        assert done.returncode == 2, done
        assert "carries a credential" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "SECRETKEY" not in done.stderr and not called.exists()


def test_the_grafana_dashboard_plots_exactly_the_series_the_driver_exports():
    import json
    import re

    from orchestrator.output.metrics import EVENTS, GAUGES

    dashboard = json.loads((DEPLOY / "grafana" / "ringleader.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"ray_(ringleader_\w+?)(?:_total)?\{", expr)}
    assert used == set(GAUGES) | {EVENTS}
    assert all('ringleader_job=~"$job"' in expr for expr in exprs)
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-gcp.yaml"])
def test_cluster_configs_pass_rays_own_validation(name):
    """What ``ray up`` checks before it touches a cloud: defaults filled in, then Ray's schema."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / name).read_text())
    validate_config(prepare_config(config))
    config["available_node_types"]["worker"]["typo_field"] = 1
    with pytest.raises(Exception, match="typo_field"):
        validate_config(prepare_config(config))


def test_the_dockerfile_builds_on_the_ray_image_with_torch_pinned():
    lines = [line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0] == "FROM rayproject/ray:2.60.0-py311-cpu"
    assert any('"torch==2.13.0"' in line and "whl/cpu" in line for line in lines)
    cluster = yaml.safe_load((DEPLOY / "cluster-gcp.yaml").read_text())
    assert cluster["docker"]["image"] == lines[0].split()[1]


def test_the_rayjob_is_kubernetes_yaml_for_kuberay():
    rayjob = yaml.safe_load((DEPLOY / "k8s" / "rayjob.yaml").read_text())
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    assert rayjob["metadata"]["name"].replace("-", "").isalnum() and rayjob["metadata"]["name"].islower()
    cluster = rayjob["spec"]["rayClusterSpec"]
    images = [c["image"] for c in cluster["headGroupSpec"]["template"]["spec"]["containers"]]
    images += [c["image"] for g in cluster["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]]
    assert images and all(i.startswith("rayproject/ray:2.60.0") for i in images)
