"""metrics.jsonl: one record per optimizer step, written by rank 0 as the run goes.

``open_metrics`` cuts a resumed run's file back to its checkpoint (torn or foreign lines dropped
with a warning), ``write_record`` appends a line (``gradnorm.trainer.record`` builds it from global
statistics, the same on every rank) and has the console show it, ``sync`` puts the file on disk
before a checkpoint that covers its lines. What a person sees of it is ``gradnorm.trainer.logs.console``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.logs import console
from gradnorm.trainer.ownership.history import write_config
from gradnorm.trainer.logs.phases import METRIC_KEYS

TIMING_KEYS = ("tokens_per_second", "elapsed_s", "max_memory_gib", *METRIC_KEYS)
"""Measured metrics (wall time; CUDA memory): everything else in metrics.jsonl is a function of the config."""





def open_run_files(out: Path, cfg: TrainConfig, world_size: int, step: int, warmup: dict, record: dict | None = None):
    """config.json (with its history), warmup.json, and metrics.jsonl opened for appending after ``step``
    (``record``: the checkpoint's copy of the line of ``step``)."""
    out.mkdir(parents=True, exist_ok=True)
    write_config(out, cfg, world_size, step)
    (out / "warmup.json").write_text(json.dumps(warmup, indent=2) + "\n")
    return open_metrics(out / "metrics.jsonl", step, record)


def sync(metrics) -> None:
    """metrics.jsonl's lines on disk, not only in the page cache: called before each checkpoint."""
    metrics.flush()
    os.fsync(metrics.fileno())


def open_metrics(path: Path, keep_through_step: int, record: dict | None = None):
    """metrics.jsonl for appending, cut back to the steps <= ``keep_through_step`` (0: a fresh file).

    A resumed run's file may be missing (it starts again after the checkpoint's step), end in a
    torn line (a crash mid-write) or hold lines that are not records (edited by hand): those lines
    are dropped with a warning naming the file and the line. The line of the checkpoint's own step
    is never lost silently: when it is gone, ``record`` (the checkpoint's copy of it) takes its
    place, or a warning says it is lost (a checkpoint of an earlier version holds no copy). The cut
    file replaces the old one atomically, so a crash now loses nothing.
    """
    kept, logged = [], set()
    if keep_through_step > 0 and not path.exists():
        print(f"warning: {path} is missing; it starts again at step {keep_through_step + 1}", file=sys.stderr, flush=True)
    elif keep_through_step > 0:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for number, line in enumerate(lines, start=1):
            try:
                step = json.loads(line)["step"] if line.strip() else None
            except (ValueError, KeyError, TypeError):
                step = "bad"
            if step is None:
                continue
            if not isinstance(step, int) or isinstance(step, bool):
                why = "a torn last line (the run stopped mid-write)" if number == len(lines) else "not a metrics record"
                print(f"warning: {path}:{number}: dropped {why}", file=sys.stderr, flush=True)
            elif step <= keep_through_step:
                kept.append(line)
                logged.add(step)
        if keep_through_step not in logged and record is not None and record.get("step") == keep_through_step:
            kept.append(json.dumps(record))
            print(f"warning: {path}: the record of step {keep_through_step} was torn or missing; restored from "
                  "its checkpoint", file=sys.stderr, flush=True)
        elif keep_through_step not in logged:
            print(f"warning: {path}: the record of step {keep_through_step} is torn or missing and its checkpoint "
                  "holds no copy (an earlier version wrote it): that step has no line", file=sys.stderr, flush=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return open(path, "a")


def timing_fields(device: torch.device) -> dict:
    """CUDA's peak memory, when there is a GPU (a measurement, like the phase times)."""
    return {"max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30} if device.type == "cuda" else {}


def write_record(metrics, bar, record: dict, cfg: TrainConfig) -> None:
    """Append the record to metrics.jsonl, then show it (``console.show``)."""
    metrics.write(json.dumps(record) + "\n")
    metrics.flush()
    console.show(bar, record, cfg)
