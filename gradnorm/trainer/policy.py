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

Prompts once. A chunk's rows come in groups that share a prompt; ``HFPolicy.score`` computes each
distinct prompt once and the responses against copies of its KV cache (``hf.response_logprobs``,
two calls where the model allows it: ``hf.prompts_once``), the same log-probs to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from gradnorm.dist import comm, wrap
from gradnorm.models import hf, llama_decode
from gradnorm.models import tinygpt
from gradnorm.models.tinygpt import GPTConfig, TinyGPT, token_logprobs_and_entropy
from gradnorm.tasks import RepeatTask, Task, builtin_task
from gradnorm.tasks.prompts import PromptTask
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer import guards
from gradnorm.trainer.guards import InputError
from gradnorm.trainer.rollout import seeded_generator


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
                                    share_prompts=self.prompts_once(module) is None)

    def prompts_once(self, module: nn.Module) -> str | None:
        """Why scoring through ``module`` computes every row's prompt, or None when it computes each
        distinct prompt once (``hf.prompts_once``)."""
        return hf.prompts_once(module)

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
        why_not = self.prompts_once(module)
        return "each distinct prompt once (gradnorm.models.hf.response_logprobs)" if why_not is None \
            else f"every row's prompt ({why_not})"


def build_policy(cfg: TrainConfig, device: torch.device, world_size: int = 1,
                 sharing: int = 1) -> tuple[Task, Policy]:
    """(task, policy): the built-in task and TinyGPT, or JSONL prompts and a Hugging Face model.

    With a Hugging Face model some checks can only be made here, each a one-line ``InputError``
    (exit code 2). The longest prompt's length comes from the tokenizer, before the weights load:
    prompt + response must fit the model's context and the memory estimate at that length
    (``guards.check_prompt_length``; ``world_size`` ranks, ``sharing`` of them on this host), and a
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
    guards.check_prompt_length(cfg, task.prompt_len, world_size, device, sharing)
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


# ---------------------------------------------------------------------------------------------
# Packed rows: a microbatch without padding.
# ---------------------------------------------------------------------------------------------


ROW_WIDTHS = 4
"""A packed row holds as many positions as this many rows of the padded batch (``pack``)."""


@dataclass
class PackedRows:
    """A microbatch's sequences concatenated into r rows of C positions (a few padded rows' width).

    Each sequence is its prompt without left padding, then its response (|o_i| tokens); sequences
    fill the rows first fit, in order, and the ends of rows are filler (segment -1, never attended
    to by a sequence and never scored).
    """

    tokens: Tensor  # (r, C) long
    position_ids: Tensor  # (r, C) 0, 1, ... restarting at every sequence (0 on filler)
    segment_ids: Tensor  # (r, C) which sequence of the microbatch a position holds; -1 on filler
    keep: tuple[Tensor, Tensor]  # (row, col) of the K positions whose logits predict a response token
    targets: Tensor  # (K,) the response tokens they predict
    out: tuple[Tensor, Tensor]  # (sequence, response position) of each of the K predictions

    @property
    def positions(self) -> int:
        """The positions a forward over these rows computes, r * C."""
        return self.tokens.numel()


def pack(tokens: Tensor, prompt_len: int, lengths: Tensor, pad_id: int | None = None,
         rows_of: int = ROW_WIDTHS) -> PackedRows:
    """``tokens`` (n, P + R) of a microbatch, with response lengths ``lengths`` (n,), as packed rows.

    With ``pad_id`` the leading run of it in each prompt is left padding and is dropped. Rows are
    ``rows_of`` times as wide as the batch (``ROW_WIDTHS``): wider rows leave less filler at their
    ends, and cost more attention per token (each position attends within its row's mask).
    """
    n, width = tokens.shape
    P, device = prompt_len, tokens.device
    lengths = lengths.to(device=device, dtype=torch.long)
    if pad_id is None:
        starts = torch.zeros(n, dtype=torch.long, device=device)
    else:  # the left padding of each prompt: its leading run of PAD ids
        starts = (torch.cumsum(tokens[:, :P] != pad_id, dim=1) == 0).sum(1)
    spans = P + lengths - starts  # (n,) tokens of each sequence: its real prompt, then its response
    # as wide as a few padded rows, never wider than the whole microbatch (one row then holds it all)
    capacity = max(min(rows_of * width, int(spans.sum())), int(spans.max())) if n else 1
    room, row_of, offset_of = [], [], []  # first fit, in the microbatch's order (cheap: n integers)
    for span in spans.tolist():
        row = next((k for k, free in enumerate(room) if free >= span), None)
        if row is None:
            row = len(room)
            room.append(capacity)
        row_of.append(row)
        offset_of.append(capacity - room[row])
        room[row] -= span
    r = max(len(room), 1)
    # Every position of every sequence at once: sequence i's j-th token goes to (row_i, offset_i + j).
    seq = torch.repeat_interleave(torch.arange(n, device=device), spans)  # (L,) which sequence
    first = torch.cumsum(spans, 0) - spans  # (n,) where each sequence starts in the flat order
    j = torch.arange(len(seq), device=device) - first[seq]  # (L,) position inside its sequence
    row = torch.tensor(row_of, dtype=torch.long, device=device)[seq]
    col = torch.tensor(offset_of, dtype=torch.long, device=device)[seq] + j
    packed = torch.zeros(r, capacity, dtype=tokens.dtype, device=device)
    packed[row, col] = tokens[seq, starts[seq] + j]
    position_ids = torch.zeros(r, capacity, dtype=torch.long, device=device)
    position_ids[row, col] = j
    segment_ids = torch.full((r, capacity), -1, dtype=torch.long, device=device)
    segment_ids[row, col] = seq
    # Position j of sequence i predicts its token j + 1: a response token when j + 1 >= its prompt.
    prompt = (P - starts)[seq]  # (L,) the sequence's real prompt length
    predicts = (j >= prompt - 1) & (j <= spans[seq] - 2)
    keep = (row[predicts], col[predicts])
    return PackedRows(tokens=packed, position_ids=position_ids, segment_ids=segment_ids, keep=keep,
                      targets=packed[keep[0], keep[1] + 1], out=(seq[predicts], (j - prompt + 1)[predicts]))


def score_packed(policy: Policy, module: nn.Module, tokens: Tensor, prompt_len: int,
                 lengths: Tensor) -> tuple[Tensor, Tensor]:
    """(logp, entropy), each (n, R) as ``score_by_length`` returns them, from one packed forward.

    Inside the response mask the values equal the padded ones to fp32 rounding; outside it they
    are 0. Differentiable.
    """
    n, R = tokens.shape[0], tokens.shape[1] - prompt_len
    rows = pack(tokens, prompt_len, lengths, policy.pad_id)
    logits = policy.packed_logits(module, rows)  # (r, C, V)
    logp, entropy = token_logprobs_and_entropy(logits[rows.keep], rows.targets)  # (K,) each, fp32
    out_logp = logp.new_zeros(n, R).index_put(rows.out, logp)
    out_entropy = entropy.new_zeros(n, R).index_put(rows.out, entropy)
    return out_logp, out_entropy


def forward_positions(tokens: Tensor, lengths: Tensor, prompt_len: int, pad_id: int | None = None,
                      packed: bool = False, max_chunks: int = 4) -> int:
    """The token positions the forward of one microbatch computes: each chunk of ``score_by_length``
    is n rows cut to its longest response, or, packed, the rows ``pack`` fills."""
    lengths = lengths.cpu()
    if packed:
        return pack(tokens, prompt_len, lengths, pad_id).positions
    return sum(len(rows) * (prompt_len + max(int(lengths[rows].max()), 1))
               for rows in length_chunks(lengths, prompt_len, max_chunks))


def score_by_length(score: Callable[[nn.Module, Tensor, int], tuple[Tensor, Tensor]], model: nn.Module, tokens: Tensor, prompt_len: int, lengths: Tensor,
                    max_chunks: int = 4, calls: int | None = None) -> tuple[Tensor, Tensor]:
    """``score(model, tokens, prompt_len)`` computed chunk by chunk; (logp, entropy), each (n, R).

    tokens (n, P + R); lengths (n,) the response lengths |o_i| from the response mask (the
    positions a chunk drops are outside the mask). Differentiable: gradients flow to every chunk.

    ``calls`` makes exactly that many forward calls (at least the chunks'): under FSDP2 every
    forward is a collective (each block's parameters are all-gathered), so ranks whose rows chunk
    differently must still call the model equally often, or the gathers pair up wrongly and the
    ranks hang. The extra calls score one row's first response token and add it times zero: no
    value changes, and the backward still visits every block (``lockstep_calls``).
    """
    n, R = tokens.shape[0], tokens.shape[1] - prompt_len
    chunks = length_chunks(lengths, prompt_len, max_chunks)
    extra = 0 if calls is None else calls - len(chunks)
    if extra < 0:
        raise ValueError(f"calls={calls} is fewer than the {len(chunks)} chunks these rows need")
    if len(chunks) <= 1 and not extra:
        return score(model, tokens, prompt_len)
    logp, entropy = tokens.new_zeros(n, R, dtype=torch.float32), tokens.new_zeros(n, R, dtype=torch.float32)
    for rows in chunks:
        width = max(int(lengths[rows].max()), 1)  # this chunk's longest response
        mb_logp, mb_entropy = score(model, tokens[rows, : prompt_len + width], prompt_len)  # (n_c, width) each
        logp, entropy = logp.to(mb_logp.dtype), entropy.to(mb_entropy.dtype)
        # out-of-place index_put keeps autograd happy; columns past `width` stay 0 (masked out)
        logp = logp.index_put((rows,), torch.nn.functional.pad(mb_logp, (0, R - width)))
        entropy = entropy.index_put((rows,), torch.nn.functional.pad(mb_entropy, (0, R - width)))
    for _ in range(extra):  # lockstep: zero weight, the same blocks visited
        idle_logp, _ = score(model, tokens[:1, : prompt_len + 1], prompt_len)
        logp = logp + 0.0 * idle_logp.sum()
    return logp, entropy


def lockstep_calls(row_sets: list[Tensor], lengths: Tensor, prompt_len: int, packed: bool = False,
                   max_chunks: int = 4) -> int:
    """The forward calls that scoring each rank's ``row_sets[r]`` (its rows of ``lengths``) takes,
    at most: what every rank must make under FSDP2 (``score_by_length(..., calls=)``). Every rank
    computes the same number from the rows of all ranks, which it already knows (no collective).
    A packed microbatch is one call; a rank with no rows still makes one (on a throwaway row)."""
    if packed:
        return 1
    lengths = lengths.cpu()
    return max((max(len(length_chunks(lengths[rows.cpu()], prompt_len, max_chunks)), 1) for rows in row_sets),
               default=1)
