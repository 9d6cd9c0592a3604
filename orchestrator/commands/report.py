"""``ringleader report RUN_DIR``: one self-contained HTML page of a run, with PNG plots.

Read from the run directory only (``events.jsonl``, ``telemetry.jsonl``, ``summary.json``), so
it works on a finished, failed or still running run, and on a copy of one. Plots (matplotlib,
headless): loss (train per step, eval at the end) and throughput over time, with markers for
stragglers, backups, rebalances, failures, recoveries, joins and checkpoints; a heatmap of each
worker's step seconds; shards per worker over time; the goodput breakdown. PNGs are embedded
as data URIs: the page is one file that can be mailed or attached.
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec.durable import read_jsonl, write_atomic
from jobspec.step_record import read_telemetry

#: Event kinds marked on the time plots: (label, colour).
MARKERS: dict[str, tuple[str, str]] = {
    "straggler": ("straggler", "tab:orange"),
    "backup": ("backup", "tab:olive"),
    "rebalance": ("rebalance", "tab:cyan"),
    "failure": ("failure", "tab:red"),
    "recovered": ("recovered", "tab:green"),
    "join": ("join", "tab:purple"),
    "checkpoint": ("checkpoint", "tab:gray"),
}


class ReportError(Exception):
    """The run directory cannot be reported on; the message names the file."""


@dataclass(frozen=True)
class Run:
    """What a run directory holds, parsed."""

    directory: Path
    events: list[dict[str, Any]]
    telemetry: list[dict[str, Any]]
    summary: dict[str, Any] | None
    start: float  # time.time() of the first event

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "step"]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return read_jsonl(path)
    except ValueError as err:
        raise ReportError(str(err)) from None


def read_run(directory: Path) -> Run:
    """Parse ``directory``. Raises ReportError if it holds no ``events.jsonl``."""
    if not (directory / "events.jsonl").is_file():
        raise ReportError(f"{directory} is not a run directory (no events.jsonl)")
    summary_path = directory / "summary.json"
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ReportError(f"{summary_path} is not JSON ({err})") from None
    events = _jsonl(directory / "events.jsonl")
    start = min((e["time"] for e in events), default=0.0)
    return Run(directory, events, read_telemetry(directory / "telemetry.jsonl"), summary, start)


def marker_times(run: Run) -> dict[str, list[float]]:
    """Seconds since the run's start of each marked event, by kind: a ``join`` is a ``grow``
    or a ``group_reformed`` that added workers, a ``backup`` a ``mitigation`` that started
    backups (speculative copies of late shards)."""
    found: dict[str, list[float]] = {kind: [] for kind in MARKERS}
    members: set[int] = set()
    for event in run.events:
        at = event["time"] - run.start
        kind = event["event"]
        if kind in found:
            found[kind].append(at)
        elif kind == "mitigation" and event.get("backups"):
            found["backup"].append(at)
        elif kind == "grow":
            found["join"].append(at)
        if kind == "workers_ready":
            members = {w["worker"] for w in event.get("workers", [])}
        elif kind in ("group_reformed", "grow"):
            now = set(event.get("workers", []))
            if kind == "group_reformed" and now - members:
                found["join"].append(at)
            members = now
    return found


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def _mark(axes: Any, markers: dict[str, list[float]]) -> None:
    for kind, times in markers.items():
        label, colour = MARKERS[kind]
        for index, at in enumerate(times):
            axes.axvline(at, color=colour, alpha=0.6, linewidth=1, label=label if index == 0 else None)


def plot_loss_and_throughput(run: Run, markers: dict[str, list[float]], plt: Any) -> str:
    steps = run.steps()
    times = [e["time"] - run.start for e in steps]
    figure, (loss_axes, speed_axes) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    loss_axes.plot(times, [e.get("loss") for e in steps], color="tab:blue", label="train loss")
    for event in (e for e in run.events if e["event"] == "eval"):
        value = event.get("metrics", {}).get("loss")
        if value is not None:
            loss_axes.scatter([event["time"] - run.start], [value], color="tab:red", zorder=3, label="eval loss")
    loss_axes.set_ylabel("loss")
    _mark(loss_axes, markers)
    speed = [e["samples"] / e["step_s"] if e.get("samples") and e.get("step_s") else None for e in steps]
    speed_axes.plot(times, speed, color="tab:green", label="samples/s")
    speed_axes.set_ylabel("samples/s (slowest worker's step)")
    speed_axes.set_xlabel("seconds since the run started")
    _mark(speed_axes, markers)
    loss_axes.legend(loc="upper right", fontsize=7, ncol=3)
    loss_axes.set_title("Loss and throughput, with what happened")
    return _png(figure)


#: The heatmap's most columns: longer runs are binned (the slowest step of each bin shown).
HEATMAP_COLUMNS = 2000


def plot_step_heatmap(run: Run, plt: Any) -> str:
    import numpy as np

    workers = sorted({r["worker"] for r in run.telemetry})
    first = min(r["step"] for r in run.telemetry)
    last = max(r["step"] for r in run.telemetry)
    width = max(1, -(-(last - first + 1) // HEATMAP_COLUMNS))  # steps per column
    grid = np.full((len(workers), (last - first) // width + 1), np.nan)
    row = {w: i for i, w in enumerate(workers)}
    for record in run.telemetry:
        cell = (row[record["worker"]], (record["step"] - first) // width)
        grid[cell] = np.fmax(grid[cell], record["step_s"])
    figure, axes = plt.subplots(figsize=(9, 0.5 + 0.45 * max(len(workers), 1)))
    image = axes.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                        extent=(first - 0.5, last + 0.5, len(workers) - 0.5, -0.5))
    axes.set_yticks(range(len(workers)), [f"worker {w}" for w in workers])
    axes.set_xlabel("step")
    axes.set_title("Step seconds per worker (blank: not in the group)")
    figure.colorbar(image, ax=axes, label="seconds")
    return _png(figure)


def plot_shards(run: Run, plt: Any) -> str:
    by_worker: dict[int, dict[int, int]] = {}
    for record in run.telemetry:
        by_worker.setdefault(record["worker"], {})[record["step"]] = len(record.get("shards", []))
    figure, axes = plt.subplots(figsize=(9, 3.5))
    for worker, counts in sorted(by_worker.items()):
        steps = sorted(counts)
        axes.step(steps, [counts[s] for s in steps], where="mid", label=f"worker {worker}")
    axes.set_xlabel("step")
    axes.set_ylabel("shards committed")
    axes.set_title("Shards per worker (rebalancing, stealing and backups move them)")
    axes.legend(fontsize=7, ncol=4)
    return _png(figure)


def plot_goodput(goodput: dict[str, Any], plt: Any) -> str:
    parts = {"productive": goodput["productive_s"], **goodput["lost_s"]}
    parts = {k: v for k, v in parts.items() if v > 0}
    figure, axes = plt.subplots(figsize=(9, 2.2))
    left = 0.0
    colours = plt.get_cmap("tab10")
    for index, (cause, seconds) in enumerate(parts.items()):
        axes.barh([0], [seconds], left=left, color=colours(index), label=f"{cause} {seconds:.1f}s")
        left += seconds
    axes.set_yticks([])
    axes.set_xlabel("seconds of wall time")
    axes.set_title(f"Goodput {goodput['goodput']:.1%}: where the wall time went")
    axes.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    return _png(figure)


def render(run: Run) -> str:
    """The HTML page for ``run``. Raises ReportError if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("ringleader report needs matplotlib: pip install 'ringleader[report]'") from None
    sections = []
    markers = marker_times(run)
    if run.steps():
        sections.append(("Loss and throughput", plot_loss_and_throughput(run, markers, plt)))
    if run.telemetry:
        sections.append(("Step time per worker", plot_step_heatmap(run, plt)))
        sections.append(("Shards per worker", plot_shards(run, plt)))
    if run.summary and "goodput" in run.summary:
        sections.append(("Goodput", plot_goodput(run.summary["goodput"], plt)))
    plt.close("all")
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(json.dumps(v) if isinstance(v, (dict, list)) else str(v))}</td></tr>"
        for k, v in (run.summary or {"status": "running (no summary.json yet)"}).items()
        if k in ("name", "status", "error", "steps", "samples_per_s", "final_loss", "eval", "workers", "wall_s", "events")
    )
    counts = {kind: len(times) for kind, times in markers.items()}
    figures = "".join(
        f'<h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" src="data:image/png;base64,{data}">'
        for title, data in sections
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>ringleader: {html.escape(run.directory.name)}</title>"
        "<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto}"
        "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}"
        "img{max-width:100%}</style></head><body>"
        f"<h1>Run {html.escape(run.directory.name)}</h1><table>{rows}</table>"
        f"<p>Marked events: {html.escape(', '.join(f'{k} {v}' for k, v in counts.items()))}</p>"
        f"{figures}</body></html>"
    )


def write_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write ``report.html`` for the run in ``run_dir`` into ``out_dir`` (default: the run
    directory), atomically; returns its path. Raises ReportError as ``read_run``/``render``."""
    page = render(read_run(run_dir))
    target = (out_dir or run_dir) / "report.html"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, lambda handle: handle.write(page.encode()), shared=True)
    except OSError as err:
        raise ReportError(f"cannot write {target}: {err.strerror or err}") from None
    return target
