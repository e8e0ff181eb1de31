"""What a run writes as it goes: metrics.jsonl (one record per optimizer step), the console, the summary.

Rank 0 alone writes. ``open_metrics`` cuts a resumed run's file back to its checkpoint (torn or
foreign lines dropped with a warning), ``step_record`` builds one line from global statistics (the
same on every rank), ``write_record`` appends it and shows it, ``summarize`` prints the outcome and
draws the learning curve.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

from gradnorm.trainer import phases, rundir
from gradnorm.core.sharding import tokens_per_rank
from gradnorm.trainer.trainconfig import TrainConfig


TIMING_KEYS = ("tokens_per_second", "elapsed_s", "max_memory_gib", *phases.METRIC_KEYS)
"""Measured metrics (wall time; CUDA memory): everything else in metrics.jsonl is a function of the config."""

BAR_PHASES = ("rollout", "forward_backward", "optimizer")
"""Phase times (gradnorm.trainer.phases) the progress bar shows beside the reward."""


def open_run_files(out: Path, cfg: TrainConfig, world_size: int, step: int, warmup: dict):
    """config.json (with its history), warmup.json, and metrics.jsonl opened for appending after ``step``."""
    out.mkdir(parents=True, exist_ok=True)
    rundir.write_config(out, cfg, world_size, step)
    (out / "warmup.json").write_text(json.dumps(warmup, indent=2) + "\n")
    return open_metrics(out / "metrics.jsonl", step)


def open_metrics(path: Path, keep_through_step: int):
    """metrics.jsonl for appending, cut back to the steps <= ``keep_through_step`` (0: a fresh file).

    A resumed run's file may be missing (it starts again after the checkpoint's step), end in a
    torn line (a crash mid-write) or hold lines that are not records (edited by hand): those lines
    are dropped with a warning naming the file and the line. The cut file replaces the old one
    atomically, so a crash now loses nothing.
    """
    kept = []
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
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return open(path, "a")



def step_record(step, stats, grad_norm, mb, lengths, plan, rollout, skipped: int, *, tokens_per_second: float,
                elapsed_s: float, device: torch.device) -> dict:
    """One line of metrics.jsonl: global statistics of the step (non-finite values as null)."""
    record = {
        "step": step, "loss": stats["loss"], "grad_norm": float(grad_norm),
        "reward_mean": float(mb.rewards.mean()), "exact_match": float((mb.rewards == 1.0).float().mean()),
        "response_len_mean": float(lengths.float().mean()), "response_len_max": int(lengths.max()),
        "tokens": stats["tokens"], "tokens_per_rank": tokens_per_rank(plan, lengths),
        **{k: stats[k] for k in ("pg_loss", "kl", "clipfrac", "entropy") if k in stats},
        "rollout_digest": rollout.digest(), "skipped_steps": skipped,
        "tokens_per_second": tokens_per_second, "elapsed_s": elapsed_s,
        **({"max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30} if device.type == "cuda" else {}),
    }
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}



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
    bar.set_postfix(reward=show("reward_mean", ".3f"), tok_s=show("tokens_per_second", ".0f"),
                    **{p: show(f"time_{p}_s", ".2f") + "s" for p in timed})
    step = record["step"]
    if bar.disable and (step % cfg.log_every == 0 or step == cfg.steps):
        print(" ".join([f"step {step}/{cfg.steps} reward {show('reward_mean', '.3f')} loss {show('loss', '.4f')} "
                        f"grad_norm {show('grad_norm', '.4f')} tokens/s {show('tokens_per_second', '.0f')}",
                        *(f"{p} {show(f'time_{p}_s', '.3f')}s" for p in timed)]), flush=True)



def summarize(out: Path, plot: bool) -> None:
    """Print the run's outcome and draw its learning curve (rank 0)."""
    from gradnorm.trainer.curves import write_learning_curve
    from gradnorm.teach.runs import read_metrics

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
