"""What a person sees of a run: each step's line (a progress bar on a terminal, else a line every
--log-every steps) and the summary at the end, printed by rank 0."""

from __future__ import annotations

import json
from pathlib import Path

from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.logs.curves import read_metrics, write_learning_curve

BAR_PHASES = ("rollout", "forward_backward", "optimizer")
"""Phase times (``gradnorm.trainer.logs.phases``) the progress bar shows beside the reward."""


def show(bar, record: dict, cfg: TrainConfig) -> None:
    """One step's record on the progress bar, or as a line every --log-every steps without a terminal.

    A skipped step's non-finite statistics are None in the record; they print as null.
    """

    def value(key: str, spec: str) -> str:
        return "null" if record.get(key) is None else format(record[key], spec)

    timed = [p for p in BAR_PHASES if record.get(f"time_{p}_s") is not None]  # where the step's time went
    bar.update(1)
    skew = {"skew": f"{record['skew_max']:.2f}x"} if record.get("skew_max") is not None else {}  # local's loudest token
    bar.set_postfix(reward=value("reward_mean", ".3f"), **skew, tok_s=value("tokens_per_second", ".0f"),
                    **{p: value(f"time_{p}_s", ".2f") + "s" for p in timed})
    step = record["step"]
    if bar.disable and (step % cfg.log_every == 0 or step == cfg.steps):
        print(" ".join([f"step {step}/{cfg.steps} reward {value('reward_mean', '.3f')} loss {value('loss', '.4f')} "
                        f"grad_norm {value('grad_norm', '.4f')} tokens/s {value('tokens_per_second', '.0f')}",
                        *(f"{p} {value(f'time_{p}_s', '.3f')}s" for p in timed)]), flush=True)


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
