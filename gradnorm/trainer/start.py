"""Where a run starts and how it continues: the policy, the warm-up, the counters, the checkpoints.

A fresh run builds the policy (TinyGPT on the built-in task, or a Hugging Face model on JSONL
prompts) and, for the built-in task, warms it up on demonstrations; a resumed one finds the latest
complete checkpoint (``resume_point``, after the run's flags are checked against its config.json)
and restores ``RunState`` and every tensor, resharded to this run's world size and --parallel."""

from __future__ import annotations

import time
from pathlib import Path

from gradnorm.dist import comm
from gradnorm.tasks import Task
from gradnorm.trainer.checkpoint.checkpointer import RUN_FIELDS, RunState
from gradnorm.trainer.checkpoint.store import read_run_state
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.policy import Policy
from gradnorm.trainer.rollout import sampled_reward
from gradnorm.trainer.warmup import warm_up


def start_or_resume(run: RunState, cfg: TrainConfig, policy: Policy, task: Task, ckpt_path: Path | None,
                    autocast) -> None:
    """Fill ``run``: a fresh run's warm-up record (reward, warm-up, reward), or the checkpoint's
    counters (its tensors are loaded by the checkpointer once the model is wrapped, into this run's
    shards)."""
    if ckpt_path is not None:
        saved = read_run_state(ckpt_path, required=RUN_FIELDS)
        for name in RUN_FIELDS:
            setattr(run, name, saved[name])
        return
    t = time.perf_counter()
    with autocast():
        before = sampled_reward(policy, task, cfg.eval_prompts, cfg.temperature, cfg.seed)
    after = before
    if cfg.builtin:  # a Hugging Face model starts from its own (pretrained) weights
        warm_up(policy.model, task, cfg)
        with autocast():
            after = sampled_reward(policy, task, cfg.eval_prompts, cfg.temperature, cfg.seed)
    run.warmup = {"steps": cfg.warmup_steps if cfg.builtin else 0, "reward_before": before,
                  "reward_after": after, "seconds": time.perf_counter() - t}
    comm.print0(f"warm-up: {run.warmup['steps']} supervised steps, sampled reward {before:.3f} -> {after:.3f}")
