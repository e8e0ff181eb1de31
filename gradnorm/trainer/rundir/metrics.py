"""What a run writes as it goes: metrics.jsonl (one record per optimizer step), the console, the summary.

Rank 0 alone writes. ``open_metrics`` cuts a resumed run's file back to its checkpoint (torn or
foreign lines dropped with a warning), ``step_record`` builds one line from global statistics (the
same on every rank), ``write_record`` appends it and shows it, ``summarize`` prints the outcome and
draws the learning curve.

The learning curve (``learning_curve.png``) is drawn by ``gradnorm.trainer.rundir.curves``, which loads no
distributed code, so the notebooks draw it too."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from gradnorm.trainer.rundir.curves import read_metrics, write_learning_curve

from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.rundir.history import write_config
from gradnorm.trainer.rundir.phases import METRIC_KEYS

TIMING_KEYS = ("tokens_per_second", "elapsed_s", "max_memory_gib", *METRIC_KEYS)
"""Measured metrics (wall time; CUDA memory): everything else in metrics.jsonl is a function of the config."""


BAR_PHASES = ("rollout", "forward_backward", "optimizer")
"""Phase times (gradnorm.trainer.rundir) the progress bar shows beside the reward."""


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
    """Append the record to metrics.jsonl and show it (progress bar, or a line every --log-every steps).

    A skipped step's non-finite statistics are None in the record; they print as null.
    """
    metrics.write(json.dumps(record) + "\n")
    metrics.flush()

    def show(key: str, spec: str) -> str:
        return "null" if record.get(key) is None else format(record[key], spec)

    timed = [p for p in BAR_PHASES if record.get(f"time_{p}_s") is not None]  # where the step's time went
    bar.update(1)
    skew = {"skew": f"{record['skew_max']:.2f}x"} if record.get("skew_max") is not None else {}  # local's loudest token
    bar.set_postfix(reward=show("reward_mean", ".3f"), **skew, tok_s=show("tokens_per_second", ".0f"),
                    **{p: show(f"time_{p}_s", ".2f") + "s" for p in timed})
    step = record["step"]
    if bar.disable and (step % cfg.log_every == 0 or step == cfg.steps):
        print(" ".join([f"step {step}/{cfg.steps} reward {show('reward_mean', '.3f')} loss {show('loss', '.4f')} "
                        f"grad_norm {show('grad_norm', '.4f')} tokens/s {show('tokens_per_second', '.0f')}",
                        *(f"{p} {show(f'time_{p}_s', '.3f')}s" for p in timed)]), flush=True)


def summarize(out: Path, plot: bool) -> None:
    """Print the run's outcome and draw its learning curve (rank 0)."""
    rows = read_metrics(out / "metrics.jsonl")
    last = rows[-10:]
    warmup = json.loads((out / "warmup.json").read_text())
    print(f"reward: {warmup['reward_before']:.3f} before warm-up, {warmup['reward_after']:.3f} after; "
          f"mean of the last {len(last)} steps {sum(r['reward_mean'] for r in last) / len(last):.3f} "
          f"(max 1.0); {rows[-1]['elapsed_s']:.0f} s of GRPO")
    if not plot:
        return
    try:
        print(f"learning curve: {write_learning_curve(out)}")
    except ImportError:
        print("learning curve skipped: matplotlib is not installed (pip install -e '.[notebooks]')")
