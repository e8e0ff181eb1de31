"""Reading training runs of ``gradnorm/train.py``: their config.json and metrics.jsonl.

``read_metrics`` is the one reader of a metrics.jsonl (the trainer's summary, its learning curve
and the notebooks use it), ``moving_average`` the one trailing average drawn over noisy curves.
``load_run`` reads a finished run of ``gradnorm/train.py``; ``gradnorm.teach.launch.train_run``
launches one. ``clipped_steps`` and ``seed_spread`` are the numbers notebook 03 reads off runs
before it says anything about them. Nothing here starts a process.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gradnorm.trainer.curves import moving_average, read_metrics


@dataclass(frozen=True)
class TrainingRun:
    """One run of ``gradnorm/train.py``: its settings and the rows of its metrics.jsonl."""

    label: str
    loss_denominator: str
    shard: str
    output_dir: Path
    metrics: list[dict]  # one dict per optimizer step
    wall_s: float  # the whole run, warm-up and process start included
    config: dict = field(default_factory=dict)  # the run's config.json: every flag, and the world size

    def series(self, key: str) -> np.ndarray:
        """(steps,) one logged value per optimizer step."""
        return np.array([row[key] for row in self.metrics], dtype=float)

    @property
    def steps(self) -> np.ndarray:
        return self.series("step")

    def rank_token_share(self, rank: int = 0) -> np.ndarray:
        """(steps,) the share of each step's response tokens that ``rank`` held."""
        return np.array([row["tokens_per_rank"][rank] / max(row["tokens"], 1) for row in self.metrics])


def load_run(output_dir: str | Path, label: str | None = None, wall_s: float = float("nan")) -> TrainingRun:
    """A finished run from its output directory (config.json and metrics.jsonl)."""
    output_dir = Path(output_dir)
    config = json.loads((output_dir / "config.json").read_text())
    denominator, shard = str(config["loss_denominator"]), str(config["shard"])
    return TrainingRun(label=label or f"{denominator}, {shard}", loss_denominator=denominator, shard=shard,
                       output_dir=output_dir, metrics=read_metrics(output_dir / "metrics.jsonl"), wall_s=wall_s,
                       config=config)


def shared_rollout_steps(a: TrainingRun, b: TrainingRun) -> int:
    """How many leading steps two runs sampled bit-identical rollouts (the trainer logs a digest)."""
    n = 0
    for row_a, row_b in zip(a.metrics, b.metrics):
        if row_a.get("rollout_digest") is None or row_a.get("rollout_digest") != row_b.get("rollout_digest"):
            break
        n += 1
    return n


def clipped_steps(run: TrainingRun, max_grad_norm: float | None = None) -> int:
    """Steps whose gradient norm before clipping exceeded ``max_grad_norm`` (default: the run's flag),
    so that clipping shortened the update."""
    limit = float(run.config["max_grad_norm"]) if max_grad_norm is None else max_grad_norm
    return int((run.series("grad_norm") > limit).sum())


@dataclass(frozen=True)
class SeedSpread:
    """One value per seed (e.g. the trailing-average reward at a step), and its mean and range."""

    values: np.ndarray  # (seeds,)

    @property
    def mean(self) -> float:
        return float(self.values.mean())

    @property
    def low(self) -> float:
        return float(self.values.min())

    @property
    def high(self) -> float:
        return float(self.values.max())


def seed_spread(seed_runs: Sequence[TrainingRun], key: str, step: int, window: int) -> SeedSpread:
    """The trailing average of ``key`` over ``window`` steps ending at ``step``, for each run (one per seed)."""
    values = []
    for run in seed_runs:
        if len(run.metrics) < step:
            raise ValueError(f"{run.label} has {len(run.metrics)} steps, fewer than {step}")
        values.append(moving_average(run.series(key)[:step], window)[-1])
    return SeedSpread(np.array(values))
