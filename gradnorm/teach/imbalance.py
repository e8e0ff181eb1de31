"""A minibatch laid out over ranks and microbatches, and what each token and rank weighs (notebook 01).

No model, only response lengths: ``imbalanced_minibatch`` lays out a minibatch with one short
microbatch, ``token_layout`` gives each sequence's per-token weight, ``rank_shares`` each rank's
share of the update against its share of the tokens, ``share_sweep`` how rank 0's shares move as
its short microbatch shrinks. The weights are the library's own (``simulate.effective_weights``),
never re-derived here.

Notebook 05 draws the same picture for SFT and DPO with their own weights: ``sft_weights_of``
(``gradnorm.sft_weights`` per microbatch, each label token one unit) and ``pair_weights_of``
(``gradnorm.pair_weights``, each preference pair one unit, ``pairs_minibatch``), both from the
counts that the step's one all-reduce would sum; ``layout_and_shares(..., objective=)`` picks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gradnorm.teach import worked_example
from gradnorm.core.denominators import Denominator, mask_from_lengths
from gradnorm.core.modes import resolve
from gradnorm.core.pairs import count_pairs, pair_weights
from gradnorm.core.sft import count_labels, sft_weights
from gradnorm.core.sharding import Plan, contiguous
from gradnorm.core.simulate import effective_weights


@dataclass(frozen=True)
class ShardedBatch:
    """A minibatch of response lengths laid out over W ranks x A microbatches."""

    lengths: Tensor  # (S,) |o_i|, int64
    group_ids: Tensor  # (S,) prompt group of each sequence
    num_groups: int
    plan: Plan  # plan[r][m]: sequence indices of rank r's microbatch m

    @property
    def mask(self) -> Tensor:  # (S, T) bool
        return mask_from_lengths(self.lengths)

    @property
    def world_size(self) -> int:
        return len(self.plan)

    @property
    def accum_steps(self) -> int:
        return len(self.plan[0])

    def microbatch_tokens(self) -> np.ndarray:
        """N[r, m] (W, A): response tokens in rank r's microbatch m."""
        return np.array([[int(self.lengths[mb].sum()) for mb in rank] for rank in self.plan])


def imbalanced_minibatch(
    world_size: int = 2,
    accum_steps: int = 2,
    imbalance: float = 4.0,
    seqs_per_microbatch: int = 2,
    full_length: int = 12,
) -> ShardedBatch:
    """Every microbatch full, except rank 0's first, whose tokens are ``imbalance`` times fewer.

    Each microbatch holds ``seqs_per_microbatch`` sequences (one prompt group) of ``full_length``
    response tokens; the sequences of rank 0's first microbatch have
    max(1, round(full_length / imbalance)) tokens. imbalance = 1 is perfectly balanced.
    """
    if imbalance < 1:
        raise ValueError(f"imbalance is a ratio of token counts, >= 1; got {imbalance}")
    num_sequences = world_size * accum_steps * seqs_per_microbatch
    short_length = max(1, round(full_length / imbalance))
    lengths = torch.full((num_sequences,), full_length, dtype=torch.int64)
    lengths[:seqs_per_microbatch] = short_length  # contiguous sharding puts these on rank 0, mb 0
    return ShardedBatch(
        lengths=lengths,
        group_ids=torch.arange(num_sequences) // seqs_per_microbatch,
        num_groups=world_size * accum_steps,
        plan=contiguous(lengths, world_size, accum_steps),
    )


def worked_example_minibatch() -> ShardedBatch:
    """The seed example of ``gradnorm.teach.worked_example``: 2 ranks x 2 microbatches, tokens 3, 14 | 12, 12."""
    return ShardedBatch(lengths=worked_example.LENGTHS.clone(), group_ids=worked_example.GROUPS.clone(), num_groups=2,
                     plan=worked_example.PLAN)


@dataclass(frozen=True)
class Layout:
    """Every sequence of a minibatch in plan order (rank by rank, microbatch by microbatch)."""

    sequence: np.ndarray  # (S,) index of the sequence in the minibatch
    rank: np.ndarray  # (S,) r
    microbatch: np.ndarray  # (S,) m
    length: np.ndarray  # (S,) |o_i|
    left: np.ndarray  # (S,) tokens laid out before this sequence
    weight: np.ndarray  # (S,) w: the weight of each of its tokens in J (one value per sequence)

    @property
    def total(self) -> np.ndarray:
        """|o_i| * w: the sequence's total weight in J."""
        return self.length * self.weight


def token_layout(batch: ShardedBatch, mode: str, max_new_tokens: int | None = None) -> Layout:
    """Per-token weight of every sequence under ``mode`` and ``batch.plan``.

    Within a sequence every mode gives all tokens the same weight, so one number per sequence
    says it all; a bar of width |o_i| and height w has the sequence's total weight as its area.
    """
    return _layout(batch, _weights(batch, mode, max_new_tokens))


def layout_and_shares(batch: ShardedBatch, mode: str, objective: str = "grpo") -> tuple[Layout, RankShares]:
    """``token_layout`` and ``batch_rank_shares`` from one computation of the weights (the explorer's).

    ``objective="sft"`` reads ``batch`` as label tokens and weighs them with ``sft_weights_of``;
    ``"dpo"`` reads it as preference pairs (``pairs_minibatch``) weighed by ``pair_weights_of``.
    """
    if objective == "grpo":
        w = _weights(batch, mode)
    elif objective == "sft":
        w = sft_weights_of(batch, mode)
    elif objective == "dpo":
        w = pair_weights_of(batch.plan, mode)
    else:
        raise ValueError(f"unknown objective {objective!r}: expected grpo, sft or dpo")
    return _layout(batch, w), _shares(batch.mask, w, batch.plan)


def _weights(batch: ShardedBatch, mode: str, max_new_tokens: int | None = None) -> Tensor:
    """(S, T) the library's effective weights of ``batch`` under a mode name."""
    max_new_tokens = int(batch.lengths.max()) if max_new_tokens is None else max_new_tokens
    denominator = resolve(mode, len(batch.lengths), max_new_tokens)
    return effective_weights(batch.mask, batch.group_ids, batch.num_groups, denominator, batch.plan)


def _layout(batch: ShardedBatch, w: Tensor) -> Layout:
    order, ranks, mbs = [], [], []
    for r, rank in enumerate(batch.plan):
        for m, mb in enumerate(rank):
            order += mb.tolist()
            ranks += [r] * len(mb)
            mbs += [m] * len(mb)
    order_t = torch.tensor(order, dtype=torch.long)
    length = batch.lengths[order_t].numpy()
    per_token = w[order_t].max(-1).values.numpy()  # the one nonzero value of each row (0 if empty)
    return Layout(
        sequence=np.array(order), rank=np.array(ranks), microbatch=np.array(mbs), length=length,
        left=np.concatenate([[0], np.cumsum(length)[:-1]]), weight=per_token,
    )


@dataclass(frozen=True)
class RankShares:
    """Each rank's share of the update next to its share of the response tokens."""

    update: np.ndarray  # (W,) sum of rank r's token weights / sum of all token weights
    tokens: np.ndarray  # (W,) tokens on rank r / N


def rank_shares(mask: Tensor, group_ids: Tensor, num_groups: int, denominator: Denominator, plan: Plan) -> RankShares:
    """How much of the update each rank's tokens carry, and how many of the tokens it holds.

    The update is J = sum w * l * M, so rank r's share of it is the sum of its tokens' weights
    over the sum of all weights (for a constant C that sum is N/C, not 1, hence the ratio).
    Invariant token-mean modes give every rank exactly its share of the tokens; ``local`` gives
    every rank with tokens in all its microbatches 1/W, whatever it holds.
    """
    return _shares(mask, effective_weights(mask, group_ids, num_groups, denominator, plan), plan)


def _shares(mask: Tensor, w: Tensor, plan: Plan) -> RankShares:
    rank_idx = [torch.cat(rank) for rank in plan]
    weight = np.array([float(w[idx].sum()) for idx in rank_idx])
    tokens = np.array([float(mask[idx].sum()) for idx in rank_idx])
    return RankShares(update=as_shares(weight), tokens=as_shares(tokens))


def batch_rank_shares(batch: ShardedBatch, mode: str) -> RankShares:
    """``rank_shares`` of a ``ShardedBatch`` under a mode name."""
    denominator = resolve(mode, len(batch.lengths), int(batch.lengths.max()))
    return rank_shares(batch.mask, batch.group_ids, batch.num_groups, denominator, batch.plan)


def as_shares(x: np.ndarray) -> np.ndarray:
    """x / sum(x): each entry's share of the total (all zero when the total is 0)."""
    total = x.sum()
    return x / total if total > 0 else np.zeros_like(x)


def weight_ratio(layout: Layout) -> float:
    """Largest over smallest per-token weight among tokens that exist: 1 means all tokens equal."""
    w = layout.weight[layout.length > 0]
    return float(w.max() / w.min()) if len(w) else 1.0


@dataclass(frozen=True)
class ShareSweep:
    """Rank 0's share of the update under each mode, and of the tokens, as the imbalance grows."""

    imbalance: np.ndarray  # (K,)
    token_share: np.ndarray  # (K,) rank 0's share of the tokens
    update_share: dict[str, np.ndarray]  # mode -> (K,) rank 0's share of the update


def share_sweep(
    imbalances: Sequence[float], world_size: int = 2, accum_steps: int = 2, modes: Sequence[str] = ("local", "token"),
    **minibatch_kwargs,
) -> ShareSweep:
    """Rank 0's shares over ``imbalanced_minibatch(world_size, accum_steps, imbalance)`` for each imbalance."""
    batches = [imbalanced_minibatch(world_size, accum_steps, k, **minibatch_kwargs) for k in imbalances]
    return ShareSweep(
        imbalance=np.asarray(imbalances, dtype=float),
        token_share=np.array([batch_rank_shares(b, "token").tokens[0] for b in batches]),
        update_share={m: np.array([batch_rank_shares(b, m).update[0] for b in batches]) for m in modes},
    )


# ---------------------------------------------------------------------------------------------
# SFT and DPO: the same layout, weighed by the library's SFT and pair weights (notebook 05)
# ---------------------------------------------------------------------------------------------


def sft_weights_of(batch: ShardedBatch, mode: str) -> Tensor:
    """(S, T) fp64: each label token's weight in J, ``batch.lengths`` read as label-token counts.

    Every microbatch gets ``gradnorm.sft_weights`` with the counts ``[N, S_tok]`` summed over every
    rank and microbatch (what the step's one all-reduce of ``count_labels`` returns). A rank
    backpropagates W * w * l and DDP averages over W, so the weight in J is w itself.
    """
    mask = batch.mask
    num_tokens, num_sequences = sum(count_labels(mask[mb]) for rank in batch.plan for mb in rank).tolist()
    w = torch.zeros(mask.shape, dtype=torch.float64)
    for rank in batch.plan:
        for mb in rank:
            w[mb] = sft_weights(mask[mb], mode, world_size=batch.world_size, accum_steps=len(rank),
                                num_tokens=num_tokens, num_sequences=num_sequences, dtype=torch.float64)
    return w


def pairs_minibatch(plan: Plan) -> ShardedBatch:
    """A plan over preference pairs as a ``ShardedBatch`` of one-unit rows, one per pair, so that
    ``layout_and_shares(..., objective="dpo")`` lays out and weighs pairs as 01 does tokens."""
    num_pairs = sum(len(mb) for rank in plan for mb in rank)
    return ShardedBatch(torch.ones(num_pairs, dtype=torch.int64), torch.arange(num_pairs), num_pairs, plan)


def pair_weights_of(plan: Plan, mode: str) -> Tensor:
    """(P, 1) fp64: each pair's weight v_p in J under ``plan``, from ``gradnorm.pair_weights`` and the
    pair count P that the step's one all-reduce of ``count_pairs`` returns."""
    num_pairs = int(sum(count_pairs(len(mb)) for rank in plan for mb in rank))
    v = torch.zeros(num_pairs, 1, dtype=torch.float64)
    for rank in plan:
        for mb in rank:
            v[mb, 0] = pair_weights(len(mb), mode, world_size=len(plan), accum_steps=len(rank), num_pairs=num_pairs,
                                    dtype=torch.float64)
    return v
