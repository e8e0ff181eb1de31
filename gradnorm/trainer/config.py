"""The trainer's configuration: the flags, their rules, and the CLI generated from them.

The rules
---------

The rules of the trainer's flags: what each numeric flag may hold, and what a --resume may change.

``BOUNDS`` has one range per numeric field of ``gradnorm.trainer.config.TrainConfig`` (``validate``
checks it and ``--help`` prints it); ``CHANGEABLE_ON_RESUME`` lists the flags that do not change a
run's mathematics, which ``gradnorm.trainer.ownership.history.compare_resumed`` lets a ``--resume`` change.

The dataclass and its CLI
-------------------------

The trainer's configuration: one dataclass, a docstring under every field, the CLI generated from it.

``python gradnorm/train.py --help`` prints each field's docstring, so this file is the reference
for every flag (``--grad-accum-steps`` is the field ``grad_accum_steps``). ``validate`` turns a bad
value into a one-line ``ValueError`` before any model is built: every numeric field has one rule
in ``BOUNDS`` (finite, in a documented range that ``--help`` prints), and ``CHANGEABLE_ON_RESUME``
lists the flags a ``--resume`` may change; every other flag defines the run and must match the
``config.json`` of the run it continues (``gradnorm.trainer.ownership.history.compare_resumed``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

import torch

from gradnorm.cli.oneline import OneLineParser  # one error: line, exit code 2
from gradnorm.core.denominators import Denominator, parse_denominator
from gradnorm.core.importance import Correction
from gradnorm.core.sharding import BUDGET_KINDS, ShardKind, check_divisible
from gradnorm.dist.wrap import ParallelKind
from gradnorm.tasks import RepeatTask

# ------------------------------------------------------------------ the rules of the flags

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
    "microbatch_tokens": Range(0, 2**31),
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
    "engine_ratio_cap": Range(1.0, 1e6, open_low=True),  # rho is bounded to [1/cap, cap]: cap 1 keeps no token
}
REPORTERS = ("tensorboard", "wandb")
"""What --report-to may name (gradnorm.trainer.logs.reporters logs to them, gradnorm.trainer.guards.preflight checks them)."""
CONSTANT_DENOMINATOR = Range(1.0, 1e15)
"""The range of a numeric --loss-denominator C, which divides every token's loss."""

CHANGEABLE_ON_RESUME = ("steps", "save_every", "log_every", "plot", "timeout_s", "cpu_threads", "backend", "device",
                        "max_skipped_steps", "gradient_checkpointing", "output_dir", "grad_accum_steps", "shard",
                        "resume", "auto_resume", "overwrite", "parallel", "rollouts", "export_hf", "report_to")
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


# ------------------------------------------------------------------ the configuration

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
    """A: microbatches per rank per optimizer step (DDP no_sync on all but the last). Changeable on
    --resume, except under --loss-denominator local (the only mode whose update depends on it)."""
    shard: ShardKind = "interleave"
    """How a minibatch's sequences are split over ranks and microbatches. length sorts by response
    length first, so low ranks get the short responses (maximal imbalance); balanced packs by tokens.
    Changeable on --resume, except under --loss-denominator local."""
    microbatch_tokens: int = 0
    """B: cut each rank's share into microbatches of at most B tokens instead of --grad-accum-steps
    equal ones (0: off). A sequence costs its prompt and response tokens, what a forward pass
    computes; ranks then hold different numbers of sequences and of microbatches, the minibatch need
    not divide by W, and a rank with fewer microbatches runs idle passes of zero weight so that every
    rank runs as many forward and backward passes. Needs --shard interleave, contiguous or length,
    --grad-accum-steps 1 and B >= prompt + max-new-tokens. Under local, each microbatch's mean is
    divided by its rank's own microbatch count (what trainers with dynamic batch sizes did)."""
    pack: bool = False
    """Padding-free microbatches: a microbatch's sequences are concatenated into one row, positions
    restart at every sequence and attention never crosses a sequence boundary. The log-probs equal
    the padded ones to fp32 rounding; the forward skips the padding, but computes each sequence's
    prompt, where a Hugging Face model's padded forward computes a group's prompt once."""

    # ---- batch and schedule
    steps: int = 300
    """Optimizer steps of GRPO (after the warm-up). Changeable on --resume (to extend a run)."""
    prompts_per_step: int = 32
    """Prompts per optimizer step; the global minibatch is prompts-per-step * group-size sequences,
    whatever the world size."""
    group_size: int = 8
    """G: completions sampled per prompt (>= 2, advantages are relative to the group)."""
    minibatches_per_rollout: int = 1
    """Minibatches (optimizer steps) per rollout batch, PPO style; 1 is fully on-policy."""
    epochs: int = 1
    """Passes over each rollout batch; more than 1 reuses samples off-policy (the clip matters)."""
    rollouts: Literal["sharded", "replicated"] = "sharded"
    """Who samples the rollout batch. sharded: each rank samples its share of the prompt groups and
    one all_gather gives every rank the whole batch (generation shrinks with W). replicated: every
    rank samples the whole batch itself (W-fold generation, no collective). Both give the same
    batch for any W: sequence i of step k draws its noise from (seed, k, i) alone. Changeable on
    --resume."""
    rollout_engine: Literal["builtin", "vllm"] = "builtin"
    """What samples the rollouts of a Hugging Face --model. builtin: the policy itself
    (gradnorm.models.hf). vllm: an in-process vLLM engine on every rank (pip install -e '.[vllm]';
    docs/vllm.md), each sampling its share of the prompt groups, its weights synced from the policy
    after every optimizer step; metrics.jsonl logs how far its log-probs are from the trainer's."""
    engine_correction: Correction = "none"
    """Importance sampling against the engine's log-probs (gradnorm.core.importance), from the
    trainer's own scores of each rollout batch: truncate multiplies each token's surrogate by
    min(rho, --engine-ratio-cap), rho = pi_trainer / pi_engine; mask drops the tokens with rho outside
    [1/cap, cap] from the loss and from the normalization's counts. Needs --rollout-engine vllm."""
    engine_ratio_cap: float = 2.0
    """The bound on rho for --engine-correction (above 1)."""

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
    as skipped_steps in metrics.jsonl); this many skipped in a row stop the run with an error.
    Changeable on --resume."""

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
    task: Literal["repeat", "bimodal"] = "repeat"
    """The built-in task (tiny model only): repeat asks for a letter n times, n uniform in 1..16;
    bimodal asks for 1-4 or 13-16 letters, half and half, so its hard cases need long responses
    (benchmarks/study.py compares the denominators on both)."""
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
    over ranks, which the loss weights undo in the same one place. Changeable on --resume
    (checkpoints are resharded to the resuming layout)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 on CUDA, fp32 on CPU. bf16 is autocast: matmuls in bfloat16; weights, gradients,
    log-softmax and loss weights stay fp32 and token counts int64, so the normalization is exact."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (Hugging Face models): less memory,
    about a third more compute, the same gradient. Changeable on --resume."""

    # ---- run
    seed: int = 0
    """Seeds the model, the warm-up and (with the step) every rollout."""
    output_dir: str = "runs/grpo"
    """Where metrics.jsonl, config.json, checkpoints and the learning curve go. Changeable on
    --resume (a run directory may be moved or copied)."""
    save_every: int = 100
    """Checkpoint every this many optimizer steps (and always at the end); 0: only at the end.
    Changeable on --resume."""
    resume: bool = False
    """Continue from the latest complete checkpoint in output-dir (its metrics.jsonl is cut back to
    it), on any number of ranks and under either --parallel. The flags that define the run must
    equal those in its config.json; only the ones documented as changeable on --resume may differ,
    and each change is recorded in config.json's history."""
    auto_resume: bool = False
    """Start the run if output-dir holds none, continue it if it holds this run (the checks of
    --resume), start it over if only its files from before a first checkpoint are there, and exit 0
    if it is complete: one command line for the first start and every restart (torchrun
    --max-restarts, a Slurm requeue). Changeable on --resume."""
    overwrite: bool = False
    """Start a fresh run in an output-dir that holds another run. Its files are moved to
    output-dir/previous_run/ and deleted once this run's first complete checkpoint exists (moved back if
    this run stops before that); without --overwrite or --resume such a directory is refused."""
    export_hf: str = "auto"
    """Where a Hugging Face --model is saved at the end with save_pretrained (safetensors and its
    tokenizer, for AutoModelForCausalLM.from_pretrained): auto is output-dir/final, none skips it.
    Changeable on --resume."""
    plot: bool = True
    """Draw learning_curve.png from metrics.jsonl at the end (needs matplotlib). Changeable on --resume."""
    report_to: str = "none"
    """Where rank 0 also logs every numeric key of each metrics.jsonl line at its step, the run's
    flags and, at the end, the learning curve: a comma list of tensorboard (event files in
    output-dir/tensorboard; pip install -e '.[report]') and wandb (Weights & Biases, offline
    unless WANDB_MODE=online: output-dir/wandb, upload later with wandb sync); none logs nothing
    more. A resumed run continues the same curves. Changeable on --resume."""
    log_every: int = 10
    """Without a terminal (no progress bar), print a line every this many steps. Changeable on --resume."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto is NCCL on CUDA and gloo on CPU. Changeable on --resume."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto is CUDA when available. Changeable on --resume (like the world size)."""
    cpu_threads: int = 1
    """torch threads per process for CPU math. Keep it equal across runs you compare: matmuls
    round differently with different thread counts, which changes sampled tokens. Changeable on
    --resume."""
    timeout_s: float = 300.0
    """How long a collective waits for a dead peer before the run fails; at least 10 s, or a slow
    step or rank 0 writing a checkpoint would look like a dead peer. Changeable on --resume."""

    @property
    def sequences_per_step(self) -> int:
        """Derived: S = prompts-per-step * group-size, the global minibatch of one optimizer step."""
        return self.prompts_per_step * self.group_size

    @property
    def longest_sequence(self) -> int:
        """Derived, built-in task only: prompt + max-new-tokens, the most tokens one sequence holds."""
        return RepeatTask(max_new_tokens=self.max_new_tokens).block_size

    @property
    def updates_per_rollout(self) -> int:
        """Derived: optimizer steps taken on each rollout batch (minibatches * epochs)."""
        return self.minibatches_per_rollout * self.epochs

    @property
    def builtin(self) -> bool:
        """Derived: whether the model is the built-in TinyGPT on the built-in task."""
        return self.model == "tiny"

    @property
    def export_dir(self) -> Path | None:
        """Derived: the directory of --export-hf, or None (the built-in model, or none)."""
        if self.builtin or self.export_hf == "none":
            return None
        return Path(self.output_dir) / "final" if self.export_hf == "auto" else Path(self.export_hf)

    def autocast_dtype(self, device_type: str) -> torch.dtype | None:
        """Derived: bfloat16 when bf16 autocast is on for ``device_type``, else None (fp32)."""
        bf16 = self.precision == "bf16" or (self.precision == "auto" and device_type == "cuda")
        return torch.bfloat16 if bf16 else None

    @property
    def reporters(self) -> tuple[str, ...]:
        """Derived: the names of --report-to, in the order given; () for none."""
        return () if self.report_to.strip() == "none" else tuple(n.strip() for n in self.report_to.split(","))

    @property
    def denominator(self) -> Denominator:
        """Derived: loss-denominator parsed into a mode name or a float C."""
        return parse_denominator(self.loss_denominator)

    def validate(self, world_size: int = 1) -> None:
        """Raise a one-line ValueError for the first bad value; ``world_size`` is W.

        Pure: flags against their ranges and each other. Files, directories, the environment and
        memory are checked by ``gradnorm.trainer.guards`` (preflight, memory).
        """
        denominator = self.denominator  # raises on an unknown denominator
        if isinstance(denominator, float) and denominator not in CONSTANT_DENOMINATOR:
            raise ValueError(f"--loss-denominator {self.loss_denominator}: a constant C must be a finite number in "
                             f"{CONSTANT_DENOMINATOR} (a token count; Dr GRPO uses prompts-per-step * group-size * "
                             "max-new-tokens)")
        for name, choices in _choices().items():
            if getattr(self, name) not in choices:
                raise ValueError(f"--{_flag(name)} {getattr(self, name)!r}: expected one of {', '.join(choices)}")
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2 (advantages compare completions of a prompt), got {self.group_size}")
        for name, allowed in BOUNDS.items():
            if getattr(self, name) not in allowed:
                value = getattr(self, name)
                what = "a finite number" if isinstance(value, float) else "an integer"
                raise ValueError(f"--{_flag(name)} must be {what} in {allowed}, got {value}")
        for name in ("output_dir", "model", "export_hf"):  # Path("") is ".": an unset variable
            if not getattr(self, name).strip():
                raise ValueError(f"--{_flag(name)} is empty; give a path")
        names = self.reporters  # () for none; "" is [""], not none
        if not set(names) <= set(REPORTERS) or len(set(names)) < len(names):
            raise ValueError(f"--report-to {self.report_to!r}: expected none, or a comma list of distinct names "
                             f"from {', '.join(REPORTERS)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"--n-head {self.n_head} must divide --n-embd {self.n_embd}")
        if self.builtin and self.max_new_tokens < 17:
            raise ValueError(f"--max-new-tokens must be >= 17 (16 letters + EOS), got {self.max_new_tokens}")
        if not self.builtin and self.task != "repeat":
            raise ValueError(f"--task {self.task} is a built-in task of the tiny model; a Hugging Face --model "
                             "trains on --prompts")
        if self.builtin and self.rollout_engine != "builtin":
            raise ValueError(f"--rollout-engine {self.rollout_engine} needs a Hugging Face --model; the built-in tiny "
                             "model samples with its own sampler")
        if self.engine_correction != "none" and self.rollout_engine != "vllm":
            raise ValueError(f"--engine-correction {self.engine_correction} reweights against a rollout engine's "
                             "log-probs: it needs --rollout-engine vllm")
        if self.builtin and self.gradient_checkpointing:
            raise ValueError("--gradient-checkpointing needs a Hugging Face --model; the built-in tiny model has none")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --output-dir and --overwrite replaces it: give one of them")
        if self.auto_resume and (self.resume or self.overwrite):
            raise ValueError(f"--auto-resume decides by itself whether to start, resume or start over: drop "
                             f"{'--resume' if self.resume else '--overwrite'}")
        if self.builtin and self.export_hf not in ("auto", "none"):
            raise ValueError("--export-hf needs a Hugging Face --model; the built-in tiny model is not one")
        if self.microbatch_tokens:
            if self.shard not in BUDGET_KINDS:
                raise ValueError(f"--microbatch-tokens {self.microbatch_tokens} cuts microbatches by tokens, and --shard "
                                 f"{self.shard} fixes W x A bins of its own: use --shard {' or '.join(BUDGET_KINDS)}")
            if self.grad_accum_steps != 1:
                raise ValueError(f"--microbatch-tokens {self.microbatch_tokens} decides how many microbatches a rank "
                                 f"runs; --grad-accum-steps {self.grad_accum_steps} would fix it too: leave it at 1")
            if self.builtin and self.microbatch_tokens < self.longest_sequence:
                raise ValueError(f"--microbatch-tokens {self.microbatch_tokens} is smaller than the longest sequence: "
                                 f"a {self.longest_sequence}-token prompt + response (prompt "
                                 f"{self.longest_sequence - self.max_new_tokens} + --max-new-tokens {self.max_new_tokens})")
        else:
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




def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one --flag per field, its help the field's docstring and range."""
    parser = OneLineParser(prog=prog, description=TrainConfig.__doc__,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints, docs, choices = get_type_hints(TrainConfig), field_docs(), _choices()
    for f in dataclasses.fields(TrainConfig):
        kind, flag = hints[f.name], f"--{_flag(f.name)}"
        doc = docs[f.name] + (f" Range: {BOUNDS[f.name]}." if f.name in BOUNDS else "")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=doc)
        elif f.name in choices:  # validated by TrainConfig.validate, so the error stays one line
            parser.add_argument(flag, default=f.default, help=doc, metavar="{" + ",".join(choices[f.name]) + "}")
        elif f.name == "loss_denominator":
            parser.add_argument(flag, default=f.default, help=doc, metavar="{local,token,sequence,group,<number>}")
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=doc)
    return parser


def given_flags(argv: list[str], parser: argparse.ArgumentParser) -> set[str]:
    """The fields whose flags appear in ``argv`` (a flag given with its default value counts)."""
    for action in parser._actions:  # parse again with no defaults: only what was given is set
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def parse_config(argv: list[str] | None = None, world_size: int = 1, prog: str | None = None) -> TrainConfig:
    """Parse command-line flags into a validated TrainConfig; raises ValueError on a bad value."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(prog).parse_args(argv)
    cfg = TrainConfig(**vars(args))
    cfg.validate(world_size)
    if cfg.builtin:  # the built-in task has its own prompts and reward: a given file would be ignored
        ignored = sorted(given_flags(argv, build_parser(prog)) & {"prompts", "reward"})
        if ignored:
            raise ValueError(f"{' and '.join('--' + name for name in ignored)} "
                             f"need{'s' if len(ignored) == 1 else ''} a Hugging Face --model; the "
                             "built-in tiny model trains on its own repeat-a-letter task and reward")
    return cfg
