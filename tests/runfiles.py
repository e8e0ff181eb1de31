"""What the trainer tests read back from a run directory (imported by the test modules, like skipping.py)."""

from pathlib import Path

from gradnorm.trainer.curves import read_metrics
from gradnorm.trainer.run import TIMING_KEYS


def metrics(out: Path) -> list[dict]:
    """Every line of ``out/metrics.jsonl``, in order."""
    return read_metrics(out / "metrics.jsonl")


def comparable(out: Path) -> list[dict]:
    """The same lines without measurements (wall times, memory): what two identical runs share."""
    return [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in metrics(out)]
