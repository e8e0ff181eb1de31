"""The trainer's configuration: one dataclass, a docstring under every field, the CLI generated from it.

``python gradnorm/train.py --help`` prints each field's docstring, so this file is the reference
for every flag (``--grad-accum-steps`` is the field ``grad_accum_steps``). ``validate`` turns a bad
value into a one-line ``ValueError`` before any model is built.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

import torch

from gradnorm.denominators import Denominator, parse_denominator
from gradnorm.prompts import get_reward, load_prompts
from gradnorm.dist.wrap import ParallelKind
from gradnorm.sharding import ShardKind, check_divisible


@dataclass
class TrainConfig:
    """GRPO on the built-in repeat-a-letter task with a tiny transformer, or on JSONL prompts with a
    Hugging Face causal LM (--model)."""

    # ---- the normalization under study
    loss_denominator: str = "token"
    """How per-token losses are averaged: local (per-microbatch mean, the old bug), token (global
    token mean), sequence (original GRPO: a mean of per-sequence means over the sequences with a
    token), group (per prompt group), or a number C (Dr GRPO uses C = prompts-per-step *
    group-size * max-new-tokens, counting every sequence)."""
    grad_accum_steps: int = 1
    """A: microbatches per rank per optimizer step (DDP no_sync on all but the last)."""
    shard: ShardKind = "interleave"
    """How a minibatch's sequences are split over ranks and microbatches. length sorts by response
    length first, so low ranks get the short responses (maximal imbalance); balanced packs by tokens."""

    # ---- batch and schedule
    steps: int = 300
    """Optimizer steps of GRPO (after the warm-up)."""
    prompts_per_step: int = 32
    """Prompts per optimizer step; the global minibatch is prompts-per-step * group-size sequences,
    whatever the world size."""
    group_size: int = 8
    """G: completions sampled per prompt (>= 2, advantages are relative to the group)."""
    minibatches_per_rollout: int = 1
    """Minibatches (optimizer steps) per rollout batch, PPO style; 1 is fully on-policy."""
    epochs: int = 1
    """Passes over each rollout batch; more than 1 reuses samples off-policy (the clip matters)."""

    # ---- GRPO objective
    beta: float = 0.0
    """KL coefficient against a frozen reference (the policy after warm-up); 0 loads no reference."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman 2020); k3 is GRPO's."""
    clip_low: float = 0.2
    """Importance ratios below 1 - clip-low stop pushing down."""
    clip_high: float = 0.28
    """Importance ratios above 1 + clip-high stop pushing up (DAPO's clip-higher; 0.2 is PPO's)."""
    scale_adv_by_std: bool = True
    """Divide advantages by the group's reward std (GRPO); --no-scale-adv-by-std centers only (Dr GRPO)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0)."""
    max_new_tokens: int = 20
    """Response budget; a response without EOS by then is truncated (and its reward halved)."""

    # ---- optimizer
    lr: float = 5e-4
    """AdamW learning rate of the GRPO updates."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; the logged grad_norm is the norm before clipping."""
    max_skipped_steps: int = 3
    """A step whose loss or gradient is NaN or inf is skipped (no optimizer step, a warning, counted
    as skipped_steps in metrics.jsonl); this many skipped in a row stop the run with an error."""

    # ---- supervised warm-up (the stand-in for pretraining)
    warmup_steps: int = 40
    """Steps of next-token training on the task's demonstrations before GRPO; 0 skips it
    (built-in model only: a Hugging Face --model starts from its own weights)."""
    warmup_batch: int = 32
    """Demonstrations per warm-up step."""
    warmup_lr: float = 3e-3
    """AdamW learning rate of the warm-up."""
    eval_prompts: int = 128
    """Prompts sampled to report the reward before and after the warm-up."""

    # ---- model
    model: str = "tiny"
    """tiny: the built-in TinyGPT on the repeat-a-letter task (sized by the three flags below).
    Anything else is a Hugging Face causal LM, a Hub name or a local directory (pip install -e
    '.[hf]'), trained on --prompts from its own weights (no warm-up)."""
    n_layer: int = 2
    """Transformer blocks (tiny)."""
    n_head: int = 4
    """Attention heads per block (tiny)."""
    n_embd: int = 64
    """Width of the residual stream (tiny)."""

    # ---- real models (a Hugging Face --model)
    prompts: str = "examples/arithmetic.jsonl"
    """JSONL file, one {"prompt": ..., "answer": ...} per line; prompts go through the tokenizer's
    chat template when it has one."""
    reward: str = "exact_match_math"
    """Reward of a response to --prompts: exact_match_math (the last \\boxed{} value, else the last
    number, equal to the answer: 1, else 0) or any package.module:function(response, answer)."""
    parallel: ParallelKind = "ddp"
    """ddp replicates the model on every rank; fsdp shards parameters, gradients and optimizer
    state per transformer block (FSDP2), for models that do not fit DDP. Both average gradients
    over ranks, which the loss weights undo in the same one place."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 on CUDA, fp32 on CPU. bf16 is autocast: matmuls in bfloat16; weights, gradients,
    log-softmax and loss weights stay fp32 and token counts int64, so the normalization is exact."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (Hugging Face models): less memory,
    about a third more compute."""

    # ---- run
    seed: int = 0
    """Seeds the model, the warm-up and (with the step) every rollout."""
    output_dir: str = "runs/grpo"
    """Where metrics.jsonl, config.json, checkpoints and the learning curve go."""
    save_every: int = 100
    """Checkpoint every this many optimizer steps (and always at the end); 0: only at the end."""
    resume: bool = False
    """Continue from the latest checkpoint in output-dir (its metrics.jsonl is cut back to it)."""
    plot: bool = True
    """Draw learning_curve.png from metrics.jsonl at the end (needs matplotlib)."""
    log_every: int = 10
    """Without a terminal (no progress bar), print a line every this many steps."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto is NCCL on CUDA and gloo on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto is CUDA when available."""
    cpu_threads: int = 1
    """torch threads per process for CPU math. Keep it equal across runs you compare: matmuls
    round differently with different thread counts, which changes sampled tokens."""
    timeout_s: float = 300.0
    """How long a collective waits for a dead peer before the run fails."""

    @property
    def sequences_per_step(self) -> int:
        """Derived: S = prompts-per-step * group-size, the global minibatch of one optimizer step."""
        return self.prompts_per_step * self.group_size

    @property
    def updates_per_rollout(self) -> int:
        """Derived: optimizer steps taken on each rollout batch (minibatches * epochs)."""
        return self.minibatches_per_rollout * self.epochs

    @property
    def builtin(self) -> bool:
        """Derived: whether the model is the built-in TinyGPT on the built-in task."""
        return self.model == "tiny"

    def autocast_dtype(self, device_type: str) -> torch.dtype | None:
        """Derived: bfloat16 when bf16 autocast is on for ``device_type``, else None (fp32)."""
        bf16 = self.precision == "bf16" or (self.precision == "auto" and device_type == "cuda")
        return torch.bfloat16 if bf16 else None

    @property
    def denominator(self) -> Denominator:
        """Derived: loss-denominator parsed into a mode name or a float C."""
        return parse_denominator(self.loss_denominator)

    def validate(self, world_size: int = 1) -> None:
        """Raise a one-line ValueError for the first bad value; ``world_size`` is W."""
        self.denominator  # noqa: B018 (raises on an unknown denominator)
        for name, choices in _choices().items():
            if getattr(self, name) not in choices:
                raise ValueError(f"--{_flag(name)} {getattr(self, name)!r}: expected one of {', '.join(choices)}")
        positive = ("steps", "prompts_per_step", "grad_accum_steps", "minibatches_per_rollout", "epochs",
                    "lr", "max_grad_norm", "temperature", "n_layer", "n_head", "n_embd", "cpu_threads",
                    "eval_prompts", "log_every", "warmup_batch", "warmup_lr", "timeout_s", "max_skipped_steps")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"--{_flag(name)} must be > 0, got {getattr(self, name)}")
        for name in ("beta", "weight_decay", "clip_low", "clip_high", "warmup_steps", "save_every"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2 (advantages compare completions of a prompt), got {self.group_size}")
        if self.n_embd % self.n_head:
            raise ValueError(f"--n-head {self.n_head} must divide --n-embd {self.n_embd}")
        if self.builtin and self.max_new_tokens < 17:
            raise ValueError(f"--max-new-tokens must be >= 17 (16 letters + EOS), got {self.max_new_tokens}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.builtin and self.gradient_checkpointing:
            raise ValueError("--gradient-checkpointing needs a Hugging Face --model; the built-in tiny model has none")
        if not self.builtin:
            _check_real_model_inputs(self.model, self.prompts, self.reward)
        check_divisible(self.sequences_per_step, world_size, self.grad_accum_steps)
        k = self.updates_per_rollout
        if self.steps % k or self.save_every % k:
            raise ValueError(f"--steps ({self.steps}) and --save-every ({self.save_every}) must be multiples of "
                             f"minibatches-per-rollout * epochs = {k}: checkpoints fall between rollouts")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available (this torch build or machine has none)")
        if self.backend == "nccl" and not (self.device != "cpu" and torch.cuda.is_available()):
            raise ValueError("--backend nccl needs a CUDA device; use gloo on CPU")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_real_model_inputs(model: str, prompts: str, reward: str) -> None:
    # Before any process group or model exists: transformers, a local model directory, the
    # prompts file and the reward (a Hub name is only checked when it loads).
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("a Hugging Face --model needs transformers: pip install -e '.[hf]'")
    if model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().is_dir():
        raise ValueError(f"--model {model}: no such directory (a local model is a save_pretrained directory)")
    try:
        load_prompts(prompts)
    except FileNotFoundError as err:
        raise ValueError(f"--prompts: {err}") from None
    get_reward(reward)


# ------------------------------------------------------------------ the CLI, generated from the fields


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _choices() -> dict[str, tuple[str, ...]]:
    hints = get_type_hints(TrainConfig)
    return {f.name: get_args(hints[f.name]) for f in dataclasses.fields(TrainConfig) if get_origin(hints[f.name]) is Literal}


def field_docs(cls: type = TrainConfig) -> dict[str, str]:
    """The docstring written under each field of a dataclass, read from its source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage too; a bad flag deserves one line
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one --flag per field, its help the field's docstring."""
    parser = _OneLineParser(prog=prog, description=TrainConfig.__doc__,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints, docs, choices = get_type_hints(TrainConfig), field_docs(), _choices()
    for f in dataclasses.fields(TrainConfig):
        kind, flag = hints[f.name], f"--{_flag(f.name)}"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=docs[f.name])
        elif f.name in choices:  # validated by TrainConfig.validate, so the error stays one line
            parser.add_argument(flag, default=f.default, help=docs[f.name], metavar="{" + ",".join(choices[f.name]) + "}")
        elif f.name == "loss_denominator":
            parser.add_argument(flag, default=f.default, help=docs[f.name], metavar="{local,token,sequence,group,<number>}")
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=docs[f.name])
    return parser


def parse_config(argv: list[str] | None = None, world_size: int = 1, prog: str | None = None) -> TrainConfig:
    """Parse command-line flags into a validated TrainConfig; raises ValueError on a bad value."""
    args = build_parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    cfg = TrainConfig(**vars(args))
    cfg.validate(world_size)
    return cfg
