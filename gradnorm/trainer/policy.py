"""The policy the trainer trains: one protocol, two adapters, and how responses are scored.

``Policy`` is everything the trainer asks of a model, so that no other module needs to know which
kind of model it holds:

    policy.model                                  the nn.Module (what the optimizer steps, what
                                                  DDP or FSDP2 wrap, what a checkpoint stores)
    policy.sample(module, prompts, R, eos, pad, temperature=, uniforms=, reduce=)
                                                  (B, P + R) tokens; row i a function of its prompt
                                                  and its uniforms alone (``gradnorm.models.sampling``)
    policy.score(module, tokens, P)               (logp, entropy) of the response tokens, each (B, R),
                                                  fp32; ``module`` is the wrapper the forward goes
                                                  through (DDP, FSDP2) or the model itself
    policy.blocks()                               the repeated blocks FSDP2 shards one by one

``TinyGPTPolicy`` adapts the built-in model (``gradnorm.models.tinygpt``), ``HFPolicy`` a Hugging
Face causal LM (``gradnorm.models.hf``); ``build_policy`` makes the one a config asks for, with its
task. ``warm_up`` is the built-in model's supervised start (departure 1 of ``gradnorm/train.py``).

Scoring in chunks. A rollout batch is cut to its longest response R, but responses are ragged: on
the built-in task they hold 2 to 17 tokens, so about a third of the positions a full-width forward
computes are padding after EOS. ``score_by_length`` sorts the rows by response length and scores
them in a few chunks, each cut to its own longest response; the per-row results are the same (a
causal model's logits at position t never see positions after t), placed back in the caller's row
order and zero after each chunk's width, where the response mask is zero anyway. The number of
chunks k is picked by a cost model in token positions: a chunk of n rows cut to width w costs
(n + ``overhead_rows``) * w, the extra rows standing for the fixed cost of one more forward call.
Several forward passes before one backward are fine under DDP (each parameter's gradient hook
still fires once per backward) and under FSDP2 (each forward gathers the parameters it needs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from gradnorm.dist import comm, wrap
from gradnorm.models import hf
from gradnorm.models import tinygpt
from gradnorm.models.tinygpt import GPTConfig, TinyGPT, token_logprobs_and_entropy
from gradnorm.tasks import RepeatTask, Task
from gradnorm.tasks.prompts import PromptTask
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.rollout import seeded_generator


class Policy(Protocol):
    """What the trainer needs of a model (the module docstring shows each call's shapes)."""

    model: nn.Module

    def sample(self, module: nn.Module, prompts: Tensor, max_new_tokens: int, eos_id: int, pad_id: int, *,
               temperature: float, uniforms: Tensor, reduce=None) -> Tensor: ...

    def score(self, module: nn.Module, tokens: Tensor, prompt_len: int) -> tuple[Tensor, Tensor]: ...

    def blocks(self) -> list[nn.Module]: ...


@dataclass
class TinyGPTPolicy:
    """The built-in TinyGPT as a ``Policy``."""

    model: TinyGPT

    def sample(self, module, prompts, max_new_tokens, eos_id, pad_id, *, temperature, uniforms, reduce=None):
        return tinygpt.generate(module, prompts, max_new_tokens, eos_id, pad_id, temperature=temperature,
                                uniforms=uniforms, reduce=reduce)

    def score(self, module, tokens, prompt_len):
        return tinygpt.response_logprobs(module, tokens, prompt_len)

    def blocks(self):
        return list(self.model.blocks)


@dataclass
class HFPolicy:
    """A Hugging Face causal LM as a ``Policy``; ``tokenizer`` is its own (kept for the export)."""

    model: nn.Module
    tokenizer: Any = None

    def sample(self, module, prompts, max_new_tokens, eos_id, pad_id, *, temperature, uniforms, reduce=None):
        return hf.generate(module, prompts, max_new_tokens, eos_id, pad_id, temperature=temperature,
                           uniforms=uniforms, reduce=reduce)

    def score(self, module, tokens, prompt_len):
        return hf.response_logprobs(module, tokens, prompt_len, pad_id=self.model.config.pad_token_id,
                                    keep_logits=hf.accepts_logits_to_keep(self.model))

    def blocks(self):
        # transformers names its repeated block classes in _no_split_modules (LlamaDecoderLayer...)
        names = set(getattr(self.model, "_no_split_modules", None) or ())
        return [m for m in self.model.modules() if type(m).__name__ in names]


def build_policy(cfg: TrainConfig, device: torch.device) -> tuple[Task, Policy]:
    """(task, policy): the built-in task and TinyGPT, or JSONL prompts and a Hugging Face model."""
    if cfg.builtin:
        task = RepeatTask(max_new_tokens=cfg.max_new_tokens)
        torch.manual_seed(cfg.seed)
        model = TinyGPT(GPTConfig(task.vocab_size, task.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd))
        return task, TinyGPTPolicy(model.to(device))
    tokenizer = hf.load_tokenizer(cfg.model)
    task = PromptTask.from_file(cfg.prompts, tokenizer, cfg.reward, cfg.max_new_tokens)
    model = hf.load_causal_lm(cfg.model, task.tokenizer.pad_id, device=device,
                              gradient_checkpointing=cfg.gradient_checkpointing)
    return task, HFPolicy(model.train(), tokenizer)


def wrap_for_training(policy: Policy, parallel: wrap.ParallelKind, ctx: comm.DistContext) -> nn.Module:
    """The module the training forward goes through: DDP, FSDP2 (block by block), or the model alone."""
    return wrap.wrap_policy(policy.model, parallel, ctx, blocks=policy.blocks())


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


def length_chunks(lengths: Tensor, prompt_len: int, max_chunks: int = 4, overhead_rows: int = 16) -> list[Tensor]:
    """Row indices (into ``lengths`` (n,)) in chunks of similar length, cheapest k by the cost model."""
    order = torch.argsort(lengths.cpu(), stable=True)  # (n,) shortest first
    widths = lengths.cpu()[order] + prompt_len  # (n,) non-decreasing

    def cost(chunks):
        return sum((len(c) + overhead_rows) * int(widths[c[-1]]) for c in chunks if len(c))

    candidates = [torch.arange(len(order)).chunk(k) for k in range(1, max(1, min(max_chunks, len(order))) + 1)]
    best = min(candidates, key=cost)
    return [order[c].to(lengths.device) for c in best if len(c)]


def score_by_length(score: Callable[[nn.Module, Tensor, int], tuple[Tensor, Tensor]], model: nn.Module, tokens: Tensor, prompt_len: int, lengths: Tensor,
                    max_chunks: int = 4) -> tuple[Tensor, Tensor]:
    """``score(model, tokens, prompt_len)`` computed chunk by chunk; (logp, entropy), each (n, R).

    tokens (n, P + R); lengths (n,) the response lengths |o_i| from the response mask (the
    positions a chunk drops are outside the mask). Differentiable: gradients flow to every chunk.
    """
    n, R = tokens.shape[0], tokens.shape[1] - prompt_len
    chunks = length_chunks(lengths, prompt_len, max_chunks)
    if len(chunks) <= 1:
        return score(model, tokens, prompt_len)
    logp = entropy = None
    for rows in chunks:
        width = max(int(lengths[rows].max()), 1)  # this chunk's longest response
        mb_logp, mb_entropy = score(model, tokens[rows, : prompt_len + width], prompt_len)  # (n_c, width) each
        if logp is None:
            logp, entropy = mb_logp.new_zeros(n, R), mb_entropy.new_zeros(n, R)
        # out-of-place index_put keeps autograd happy; columns past `width` stay 0 (masked out)
        logp = logp.index_put((rows,), torch.nn.functional.pad(mb_logp, (0, R - width)))
        entropy = entropy.index_put((rows,), torch.nn.functional.pad(mb_entropy, (0, R - width)))
    return logp, entropy
