"""A real Ray head for tests and for measuring a launch attached to a running Ray: ``ray start
--head --block`` in its own process session, on free ports, with the dashboard (the job
server), a metrics export port and token authentication, stopped by its process group id
(never ``ray stop``, which would stop every Ray on the machine)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RayHead:
    """A running head: its job server ``address``, the environment a client on this machine
    uses to reach it (``HOME`` holding its token, its ``RAY_TMPDIR``), and the token file."""

    address: str
    gcs_address: str
    env: dict[str, str]
    token_file: Path
    metrics_port: int


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(url: str, token: str) -> bool:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start_head(scratch: Path, num_cpus: int = 3) -> Iterator[RayHead]:
    """Start a head of ``num_cpus`` CPUs whose files live under ``scratch``; yields it, then
    stops it."""
    home = scratch / "home"
    home.mkdir(parents=True)
    ray_tmp = Path(tempfile.mkdtemp(prefix="rlh-", dir="/tmp"))  # Ray's socket paths must be short
    try:
        yield from _run_head(scratch, home, ray_tmp, num_cpus)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _run_head(scratch: Path, home: Path, ray_tmp: Path, num_cpus: int) -> Iterator[RayHead]:
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(HOME=str(home), RAY_TMPDIR=str(ray_tmp), RAY_AUTH_MODE="token", PATH=f"{bin_dir}:{env.get('PATH', '')}")
    env["RAY_metrics_report_interval_ms"] = "1000"  # metrics reach the endpoint within a second
    # No drain on SIGTERM: Ray would ask the GCS to drain the node and wait up to 30 s for its
    # answer, but ``_stop`` signals the whole group, so the GCS is gone at once and that wait
    # always ran out (30 s per head stopped). There is nothing here a drain would let finish.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    # The token, as a cluster admin makes it (Ray writes it to $HOME/.ray/auth_token).
    subprocess.run([f"{bin_dir}/ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True, timeout=60)
    port, dashboard, metrics = free_port(), free_port(), free_port()
    log = open(scratch / "head.log", "wb")
    head = subprocess.Popen(
        [
            f"{bin_dir}/ray", "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dashboard}",
            "--dashboard-host=127.0.0.1", "--include-dashboard=true", f"--num-cpus={num_cpus}", f"--temp-dir={ray_tmp}",
            f"--ray-client-server-port={free_port()}", f"--metrics-export-port={metrics}", "--disable-usage-stats",
            # Off the defaults: the test session's own Ray holds them (a head whose job agent
            # cannot bind answers every submission "no available agent").
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        token = (home / ".ray" / "auth_token").read_text().strip()
        while not _answers(f"{address}/api/version", token):
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not start:\n{(scratch / 'head.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield RayHead(address, f"127.0.0.1:{port}", env, home / ".ray" / "auth_token", metrics)
    finally:
        _stop(head)
        log.close()


def _stop(head: subprocess.Popen[bytes]) -> None:
    """SIGTERM the head's process group (the head and every Ray process it started), then
    SIGKILL what is left after ``STOP_TIMEOUT_S``."""
    group = os.getpgid(head.pid) if head.poll() is None else head.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        try:
            head.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            time.sleep(1.0)  # let its children exit, then make sure
