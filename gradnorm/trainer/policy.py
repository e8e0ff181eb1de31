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
    policy.packed_logits(module, rows)            (r, C, V) logits of packed rows (``PackedRows``):
                                                  positions restart and attention stays inside
                                                  each sequence, so each gets the logits it gets alone
    policy.pad_id                                 the id that left-pads prompts (None: they are not)

``TinyGPTPolicy`` adapts the built-in model (``gradnorm.models.tinygpt``), ``HFPolicy`` a Hugging
Face causal LM (``gradnorm.models.hf``); ``build_policy`` makes the one a config asks for, with its
task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from gradnorm.models import hf, llama_decode, tinygpt
from gradnorm.models.tinygpt import GPTConfig, TinyGPT
from gradnorm.tasks import Task, builtin_task
from gradnorm.tasks.prompts import PromptTask
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.guards import memory
from gradnorm.trainer.guards.failures import InputError
from gradnorm.trainer.packing import PackedRows, score_packed


class Policy(Protocol):
    """What the trainer needs of a model (the module docstring shows each call's shapes)."""

    model: nn.Module

    def sample(self, module: nn.Module, prompts: Tensor, max_new_tokens: int, eos_id: int, pad_id: int, *,
               temperature: float, uniforms: Tensor, reduce=None) -> Tensor: ...

    def score(self, module: nn.Module, tokens: Tensor, prompt_len: int) -> tuple[Tensor, Tensor]: ...

    def blocks(self) -> list[nn.Module]: ...

    def packed_logits(self, module: nn.Module, rows: PackedRows) -> Tensor: ...

    pad_id: int | None


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

    def packed_logits(self, module, rows):
        return module(rows.tokens, position_ids=rows.position_ids, segment_ids=rows.segment_ids)

    pad_id = None  # the built-in prompts all have the same length: no left padding


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
                                    keep_logits=hf.accepts_logits_to_keep(self.model),
                                    share_prompts=hf.prompts_once(module) is None)

    def blocks(self):
        # transformers names its repeated block classes in _no_split_modules (LlamaDecoderLayer...)
        names = set(getattr(self.model, "_no_split_modules", None) or ())
        return [m for m in self.model.modules() if type(m).__name__ in names]

    def packed_logits(self, module, rows):
        # No attention mask: transformers finds the sequences of a row where position_ids restart
        # and builds the block-diagonal causal mask from them (sdpa on CPU, flash attention on GPU).
        return module(input_ids=rows.tokens, position_ids=rows.position_ids, use_cache=False).logits

    @property
    def pad_id(self):
        return self.model.config.pad_token_id

    def decoding(self, total_len: int) -> str:
        """How sampling steps this model (after the prompts' prefill), in words for the run's log."""
        why_not = llama_decode.unsupported(self.model, total_len)
        return "direct steps (gradnorm.models.llama_decode)" if why_not is None else f"the model's forward ({why_not})"

    def scoring(self, module: nn.Module) -> str:
        """How the scoring and training forwards through ``module`` compute prompts, in words for the run's log."""
        why_not = hf.prompts_once(module)
        return "each distinct prompt once (gradnorm.models.hf.response_logprobs)" if why_not is None \
            else f"every row's prompt ({why_not})"


def build_policy(cfg: TrainConfig, device: torch.device, world_size: int = 1,
                 sharing: int = 1) -> tuple[Task, Policy]:
    """(task, policy): the built-in task and TinyGPT, or JSONL prompts and a Hugging Face model.

    With a Hugging Face model some checks can only be made here, each a one-line ``InputError``
    (exit code 2). The longest prompt's length comes from the tokenizer, before the weights load:
    prompt + response must fit the model's context and the memory estimate at that length
    (``memory.check_prompt_length``; ``world_size`` ranks, ``sharing`` of them on this host), and a
    --microbatch-tokens budget must hold it. --pack needs a model whose attention stays inside each
    sequence of a packed row (``check_packs``, once the model is loaded).
    """
    if cfg.builtin:
        task = builtin_task(cfg.task, cfg.max_new_tokens)
        torch.manual_seed(cfg.seed)
        model = TinyGPT(GPTConfig(task.vocab_size, task.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd))
        return task, TinyGPTPolicy(model.to(device))
    tokenizer = hf.load_tokenizer(cfg.model)
    task = PromptTask.from_file(cfg.prompts, tokenizer, cfg.reward, cfg.max_new_tokens)
    memory.check_prompt_length(cfg, task.prompt_len, world_size, device, sharing)
    if cfg.microbatch_tokens and cfg.microbatch_tokens < task.block_size:
        raise InputError(f"--microbatch-tokens {cfg.microbatch_tokens} is smaller than the longest sequence: a "
                         f"{task.block_size}-token prompt + response (the longest prompt of {cfg.prompts}, "
                         f"{task.prompt_len} tokens, + --max-new-tokens {cfg.max_new_tokens})")
    model = hf.load_causal_lm(cfg.model, task.tokenizer.pad_id, device=device,
                              gradient_checkpointing=cfg.gradient_checkpointing)
    policy = HFPolicy(model.train(), tokenizer)
    if cfg.pack:
        check_packs(policy, cfg.model)
    return task, policy


@torch.no_grad()
def check_packs(policy: Policy, name: str) -> None:
    """An ``InputError`` unless two sequences packed in one row get the log-probs they get apart.

    A model whose attention ignores restarted positions (no packed-sequence support) would let the
    second sequence attend to the first: packed training would then be silently wrong.
    """
    model = policy.model
    was_training = model.training
    model.eval()
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]], device=next(model.parameters()).device)
    lengths = torch.tensor([3, 3], device=tokens.device)
    packed = score_packed(policy, model, tokens, 3, lengths)[0]
    apart = torch.cat([policy.score(model, tokens[i:i + 1], 3)[0] for i in range(2)])
    model.train(was_training)
    if not torch.allclose(packed.float(), apart.float(), rtol=1e-3, atol=1e-4):
        raise InputError(f"--pack: {name} cannot take packed rows (its attention crosses from one sequence into "
                         "the next, so packed log-probs differ from the padded ones); train it without --pack")
