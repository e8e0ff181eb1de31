"""The learning curve of a training run, read from its metrics.jsonl and drawn on a given Axes.

``read_metrics`` reads a run's records, ``moving_average`` smooths them (the notebooks read runs the
same way, through ``gradnorm.teach.runs``); ``plot_learning_curve(ax, metrics, warmup)`` draws on a
matplotlib Axes you pass, and ``write_learning_curve(output_dir)`` is what the trainer calls at the
end. It uses matplotlib's object API with the Agg canvas, so it never needs a display, and it loads
no distributed code, so a notebook can import it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl: one dict per optimizer step, in file order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each step (fewer at the start): a trailing average."""
    values = np.asarray(values, dtype=float)
    sums = np.cumsum(np.concatenate([[0.0], values]))
    k = np.arange(1, len(values) + 1)
    lo = np.maximum(k - window, 0)
    return (sums[k] - sums[lo]) / (k - lo)


def plot_learning_curve(ax, metrics: list[dict[str, Any]], warmup: dict[str, Any] | None = None, window: int = 10):
    """Mean rollout reward per GRPO step, its moving average, and the reward around the warm-up."""
    steps = [m["step"] for m in metrics]
    rewards = [m["reward_mean"] for m in metrics]
    ax.plot(steps, rewards, color="tab:blue", alpha=0.35, lw=1, label="reward (rollout batch mean)")
    ax.plot(steps, moving_average(rewards, window), color="tab:blue", lw=2, label=f"moving average ({window} steps)")
    if warmup and warmup.get("steps"):
        ax.scatter([0, 0], [warmup["reward_before"], warmup["reward_after"]], color=["tab:red", "tab:orange"],
                   zorder=3, label=None)
        ax.annotate(f"before warm-up {warmup['reward_before']:.2f}", (0, warmup["reward_before"]),
                    textcoords="offset points", xytext=(6, 4), fontsize=8, color="tab:red")
        ax.annotate(f"after {warmup['steps']} warm-up steps {warmup['reward_after']:.2f}", (0, warmup["reward_after"]),
                    textcoords="offset points", xytext=(8, 6), fontsize=8, color="tab:orange")
    ax.set_xlabel("GRPO optimizer step")
    ax.set_ylabel("reward (max 1)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return ax


def write_learning_curve(output_dir: str | Path, filename: str = "learning_curve.png") -> Path:
    """Draw ``output_dir/metrics.jsonl`` (and warmup.json if present) into ``output_dir/filename``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    output_dir = Path(output_dir)
    metrics = read_metrics(output_dir / "metrics.jsonl")
    warmup_path = output_dir / "warmup.json"
    warmup = json.loads(warmup_path.read_text()) if warmup_path.exists() else None
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    plot_learning_curve(ax, metrics, warmup)
    config_path = output_dir / "config.json"
    if config_path.exists():
        cfg = json.loads(config_path.read_text())
        ranks = cfg.get("world_size", 1)
        ax.set_title(f"GRPO on the repeat task: {ranks} rank{'s' if ranks > 1 else ''}, "
                     f"loss denominator {cfg['loss_denominator']}", fontsize=10)
    path = output_dir / filename
    fig.savefig(path, dpi=120)
    return path
