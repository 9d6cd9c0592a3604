"""``ringleader simulate``: run a scenario, print each contender's figures side by side, and
write them as JSON and a plot."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from jobspec.durable import write_atomic
from simulator.engine import Outcome, simulate
from simulator.scenario import Scenario, load_scenario


def format_table(scenario: Scenario, outcomes: list[Outcome], seconds: float) -> str:
    """The figures of every contender, and ringleader's goodput over each baseline's."""
    lines = [
        f"{scenario.name}: {scenario.workers} workers ({scenario.nodes} nodes), {scenario.steps} steps; simulated in {seconds:.1f}s",
        f"{'contender':<14} {'goodput':>7} {'hours':>8} {'idle':>6} {'failures':>8} {'rec_p50_s':>9} {'rec_p90_s':>9} "
        f"{'redone':>6} {'ckpts':>5} {'evicted':>7} {'policy_ms':>9}",
    ]
    for outcome in outcomes:
        recovery = outcome.recovery_percentiles()
        lines.append(
            f"{outcome.contender:<14} {outcome.goodput:>7.3f} {outcome.wall_s / 3600:>8.2f} {outcome.idle_fraction:>6.3f} "
            f"{outcome.failures:>8} {recovery.get('p50', 0.0):>9.1f} {recovery.get('p90', 0.0):>9.1f} "
            f"{outcome.redone_steps:>6} {outcome.checkpoints:>5} {outcome.evictions:>7} {outcome.policy_cpu_ms:>9.2f}"
        )
    ours = next((o for o in outcomes if o.contender == "ringleader"), None)
    if ours is not None:
        ratios = [f"{o.goodput and ours.goodput / o.goodput:.2f}x {o.contender}" for o in outcomes if o is not ours]
        if ratios:
            lines.append("ringleader's goodput over: " + ", ".join(ratios))
    return "\n".join(lines)


def write_plot(path: Path, scenario: Scenario, outcomes: list[Outcome]) -> None:
    """Progress over time and the recovery times, one colour per contender (a PNG). Raises
    RuntimeError if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'ringleader[report]'") from None
    figure, (progress, recovery) = plt.subplots(1, 2, figsize=(12, 4.5))
    for outcome in outcomes:
        hours, steps = zip(*outcome.timeline)
        progress.plot(hours, steps, label=f"{outcome.contender} (goodput {outcome.goodput:.2f})")
    progress.set_xlabel("hours")
    progress.set_ylabel("steps committed")
    progress.set_title(f"{scenario.name}: {scenario.workers} workers")
    progress.legend()
    with_recoveries = [o for o in outcomes if o.recovery_s]
    if with_recoveries:
        recovery.boxplot([o.recovery_s for o in with_recoveries])
        recovery.set_xticks(range(1, len(with_recoveries) + 1), [o.contender for o in with_recoveries])
        recovery.set_yscale("log")
    recovery.set_ylabel("seconds from a failure until its step commits")
    recovery.set_title("recovery time per failure")
    figure.tight_layout()
    write_atomic(path, lambda f: figure.savefig(f, format="png", dpi=100), shared=True)
    plt.close(figure)


def main(scenario_path: str, overrides: list[str], json_path: str | None, plot_path: str | None) -> int:
    """Simulate, print, write. Raises ConfigError for a bad scenario file."""
    scenario = load_scenario(scenario_path, overrides)
    started = time.perf_counter()
    outcomes = simulate(scenario)
    seconds = time.perf_counter() - started
    print(format_table(scenario, outcomes, seconds))
    if json_path:
        report: dict[str, Any] = {
            "scenario": scenario.model_dump(mode="json"), "simulated_s": seconds,
            "contenders": [o.to_json() for o in outcomes],
        }
        text = json.dumps(report, indent=1).encode()
        write_atomic(Path(json_path), lambda f: f.write(text), shared=True)
        print(f"wrote {json_path}")
    if plot_path:
        write_plot(Path(plot_path), scenario, outcomes)
        print(f"wrote {plot_path}")
    return 0
