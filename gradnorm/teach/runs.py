"""Reading training runs of ``gradnorm/train.py``: their config.json and metrics.jsonl.

``read_metrics`` is the one reader of a metrics.jsonl (the trainer's summary, its learning curve
and the notebooks use it), ``moving_average`` the one trailing average drawn over noisy curves.
``load_run`` reads a finished run of ``gradnorm/train.py``; ``gradnorm.teach.launch.train_run``
launches one (notebook 03's live run). Nothing here starts a process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gradnorm.trainer.logs.curves import moving_average, read_metrics  # noqa: F401 (re-exported: notebook 03)


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


def load_run(output_dir: str | Path, label: str | None = None, wall_s: float = float("nan")) -> TrainingRun:
    """A finished run from its output directory (config.json and metrics.jsonl)."""
    output_dir = Path(output_dir)
    config = json.loads((output_dir / "config.json").read_text())
    denominator, shard = str(config["loss_denominator"]), str(config["shard"])
    return TrainingRun(label=label or f"{denominator}, {shard}", loss_denominator=denominator, shard=shard,
                       output_dir=output_dir, metrics=read_metrics(output_dir / "metrics.jsonl"), wall_s=wall_s,
                       config=config)
