"""The rules of the trainer's flags: what each numeric flag may hold, and what a --resume may change.

``BOUNDS`` has one range per numeric field of ``gradnorm.trainer.trainconfig.TrainConfig`` (``validate``
checks it and ``--help`` prints it); ``CHANGEABLE_ON_RESUME`` lists the flags that do not change a
run's mathematics, which ``gradnorm.trainer.rundir.compare_resumed`` lets a ``--resume`` change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """The finite values in [lo, hi], or in (lo, hi] when ``open_low``."""

    lo: float
    hi: float
    open_low: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.lo if self.open_low else value >= self.lo
        return math.isfinite(value) and above and value <= self.hi

    def __str__(self) -> str:
        lo, hi = (f"{x:g}" if isinstance(x, float) else str(x) for x in (self.lo, self.hi))
        return f"{'(' if self.open_low else '['}{lo}, {hi}]"


# One rule per numeric field. A limit is where a value stops being a setting and becomes a
# mistake: beyond it the run overflows (an lr of 1e30, a temperature of 1e-40 or a beta of 1e30
# turn the loss into inf or NaN), a seed no longer fits the 64-bit generators, or a count is absurd.
BOUNDS: dict[str, Range] = {
    "grad_accum_steps": Range(1, 4096),
    "steps": Range(1, 10**9),
    "prompts_per_step": Range(1, 10**7),
    "group_size": Range(2, 4096),
    "minibatches_per_rollout": Range(1, 4096),
    "epochs": Range(1, 1000),
    "beta": Range(0.0, 100.0),
    "clip_low": Range(0.0, 1.0),  # 1 - clip-low is the lowest ratio kept, so at most 1
    "clip_high": Range(0.0, 100.0),
    "temperature": Range(1e-3, 100.0),  # logits / T must stay finite in fp32
    "max_new_tokens": Range(1, 2**20),
    "lr": Range(0.0, 1.0, open_low=True),
    "weight_decay": Range(0.0, 1.0),  # AdamW scales the weights by 1 - lr * weight-decay each step
    "max_grad_norm": Range(0.0, 1e6, open_low=True),
    "max_skipped_steps": Range(1, 10**6),
    "warmup_steps": Range(0, 10**7),
    "warmup_batch": Range(1, 10**6),
    "warmup_lr": Range(0.0, 1.0, open_low=True),
    "eval_prompts": Range(1, 10**6),
    "n_layer": Range(1, 1024),
    "n_head": Range(1, 1024),
    "n_embd": Range(1, 2**16),
    "seed": Range(0, 2**63 - 1),
    "save_every": Range(0, 10**9),
    "log_every": Range(1, 10**9),
    "cpu_threads": Range(1, 1024),
    "timeout_s": Range(10.0, 7 * 24 * 3600.0),
}
CONSTANT_DENOMINATOR = Range(1.0, 1e15)
"""The range of a numeric --loss-denominator C, which divides every token's loss."""

CHANGEABLE_ON_RESUME = ("steps", "save_every", "log_every", "plot", "timeout_s", "cpu_threads", "backend", "device",
                        "max_skipped_steps", "gradient_checkpointing", "output_dir", "grad_accum_steps", "shard",
                        "resume", "overwrite", "parallel", "rollouts", "export_hf")
"""Flags a --resume may change (their docstrings say "Changeable on --resume"); every other flag
defines the run. A change is applied for real and recorded in config.json's history."""


def changeable_on_resume(name: str, loss_denominator: str) -> bool:
    """Whether --resume may change the flag ``name`` of a run trained with this denominator.

    A and the sharding leave the update of every invariant denominator unchanged (that is the
    point of gradnorm), so a resumed run may pick them to fit its memory; under local they change it.
    """
    if name in ("grad_accum_steps", "shard"):
        return loss_denominator != "local"
    return name in CHANGEABLE_ON_RESUME
