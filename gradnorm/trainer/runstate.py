"""Where a run starts and how it continues: the policy, the warm-up, the counters, the checkpoints.

A fresh run builds the policy (TinyGPT on the built-in task, or a Hugging Face model on JSONL
prompts) and, for the built-in task, warms it up on demonstrations; a resumed one finds the latest
complete checkpoint (``resume_point``, after the run's flags are checked against its config.json)
and restores ``RunState`` and every tensor, resharded to this run's world size and --parallel.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from gradnorm.trainer import checkpointing, rundir
from gradnorm.models import hf as hfmodels
from gradnorm.dist import comm
from gradnorm.dist import state as dist_state
from gradnorm.tasks.prompts import PromptTask
from gradnorm.trainer.rollout import sampled_reward, seeded_generator
from gradnorm.tasks import RepeatTask
from gradnorm.models.tinygpt import GPTConfig, TinyGPT, response_logprobs, token_logprobs_and_entropy
from gradnorm.trainer.trainconfig import TrainConfig


def build_policy(cfg: TrainConfig, device: torch.device):
    """(task, model, score): the built-in task and TinyGPT, or JSONL prompts and a Hugging Face model.

    ``score(model, tokens, P)`` is the model's ``response_logprobs``; the rollout picks the
    matching sampler itself (``rollout.sampler_for``).
    """
    if cfg.builtin:
        task = RepeatTask(max_new_tokens=cfg.max_new_tokens)
        torch.manual_seed(cfg.seed)
        model = TinyGPT(GPTConfig(task.vocab_size, task.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd))
        return task, model.to(device), response_logprobs
    tokenizer = hfmodels.load_tokenizer(cfg.model)
    task = PromptTask.from_file(cfg.prompts, tokenizer, cfg.reward, cfg.max_new_tokens)
    model = hfmodels.load_causal_lm(cfg.model, task.tokenizer.pad_id, device=device,
                                    gradient_checkpointing=cfg.gradient_checkpointing)
    return task, model.train(), hfmodels.response_logprobs



def warm_up(model: TinyGPT, task: RepeatTask, cfg: TrainConfig) -> None:
    """Next-token training on demonstrations (masked token-mean NLL), run identically on every rank.

    No DDP and no collectives: every rank computes the same full batch bit for bit, so the policy
    GRPO starts from is the same for every W.
    """
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
    g = seeded_generator(cfg.seed, "warmup")
    for _ in range(cfg.warmup_steps):
        tokens, loss_mask = (t.to(device) for t in task.demonstrations(cfg.warmup_batch, g))
        logp, _ = token_logprobs_and_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        mask = loss_mask[:, 1:]
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


@dataclass
class RunState:
    """Where a run stands: what a checkpoint restores besides the weights, optimizer and RNGs."""

    step: int = 0
    """Optimizer steps done."""
    warmup: dict = field(default_factory=dict)
    """The warm-up's record (warmup.json)."""
    elapsed_s: float = 0.0
    """Seconds of GRPO before this process started (a resumed run continues the clock)."""
    skipped: int = 0
    """Steps skipped for a non-finite loss or gradient, in all."""
    in_a_row: int = 0
    """The same, in a row up to the last step."""


RUN_FIELDS = tuple(f.name for f in fields(RunState))


def resume_point(cfg: TrainConfig) -> Path | None:
    """The checkpoint --resume continues from, once the run it continues is known to match.

    One-line ValueErrors: no checkpoint; a flag that defines the run differs from config.json
    (``rundir.compare_resumed``); --steps not beyond the checkpoint's step.
    """
    if not cfg.resume:
        return None
    path = checkpointing.latest_checkpoint(cfg.output_dir)
    if path is None:
        old = " (its ckpt_step*.pt files are the single-file format of earlier versions)" \
            if any(Path(cfg.output_dir).glob("ckpt_step*.pt")) else ""
        raise ValueError(f"--resume: no complete checkpoint ckpt_step*/ in {cfg.output_dir}{old}")
    rundir.compare_resumed(cfg, rundir.read_config(Path(cfg.output_dir)))
    done = re.match(r"ckpt_step(\d+)", path.name)
    if done and int(done.group(1)) >= cfg.steps:
        raise ValueError(f"--resume: {path} is at step {done.group(1)} and --steps is {cfg.steps}: nothing to do; "
                         "raise --steps to continue the run")
    return path



def start_or_resume(cfg: TrainConfig, model: torch.nn.Module, task, ckpt_path: Path | None, autocast) -> RunState:
    """A fresh run (reward, warm-up, reward), or the checkpoint's counters (its tensors are loaded
    by ``load_checkpoint`` once the model is wrapped, into this run's shards)."""
    if ckpt_path is not None:
        run = checkpointing.read_run_state(ckpt_path, required=RUN_FIELDS)
        return RunState(**{k: run[k] for k in RUN_FIELDS})
    t = time.perf_counter()
    with autocast():
        before = sampled_reward(model, task, cfg.eval_prompts, cfg.temperature, cfg.seed)
    after = before
    if cfg.builtin:  # a Hugging Face model starts from its own (pretrained) weights
        warm_up(model, task, cfg)
        with autocast():
            after = sampled_reward(model, task, cfg.eval_prompts, cfg.temperature, cfg.seed)
    warmup = {"steps": cfg.warmup_steps if cfg.builtin else 0, "reward_before": before,
              "reward_after": after, "seconds": time.perf_counter() - t}
    comm.print0(f"warm-up: {warmup['steps']} supervised steps, sampled reward {before:.3f} -> {after:.3f}")
    return RunState(warmup=warmup)



def save_checkpoint(out: Path, model, opt, ref, run: RunState, ctx: comm.DistContext) -> None:
    """Write ckpt_step{N}/: every rank its own shards, in parallel, nothing gathered on one rank."""
    checkpointing.save(out, run.step, dist_state.training_state(model, opt, ref), asdict(run), ctx.rank)



def load_checkpoint(path: Path, model, opt, ref, ctx: comm.DistContext) -> None:
    """Load a checkpoint written on any W and --parallel into this run's (possibly sharded) model."""
    state = dist_state.training_state(model, opt, ref)  # this run's layout: the placeholders to fill
    checkpointing.load(path, state, ctx.rank)
    dist_state.apply_training_state(model, opt, ref, state)
