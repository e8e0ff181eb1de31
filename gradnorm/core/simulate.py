"""W simulated ranks and A microbatches inside one process, with no process group.

The simulation runs exactly the arithmetic of a real data-parallel step: each rank counts its
tokens, the count vectors are summed (what the all-reduce returns), each microbatch backpropagates
its rank-weighted loss, gradients add up over a rank's microbatches (accumulation) and are then
averaged over ranks (DDP). Notebooks and tests use it to show any (W, A, sharding) instantly;
``gradnorm.teach.harness`` proves it equals the real multi-process result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from gradnorm.core.denominators import (
    Counts, Denominator, microbatch_loss, needs_global_counts, rank_count_vector, token_weights,
)
from gradnorm.core.sharding import Plan, validate_plan


def simulated_counts(plan: Plan, lengths: Tensor, group_ids: Tensor, num_groups: int) -> Counts:
    """The global counts, built as the all-reduce builds them: a sum of per-rank count vectors."""
    per_rank = [rank_count_vector(rank, lengths, group_ids, num_groups) for rank in plan]
    return Counts.from_vector(torch.stack(per_rank).sum(0))


def effective_weights(
    mask: Tensor,
    group_ids: Tensor,
    num_groups: int,
    denominator: Denominator,
    plan: Plan,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """(S, T): the weight each token ends up with in the averaged gradient, under ``plan``.

    A rank scales its loss by W * w and DDP divides by W, so the effective weight is w itself.
    Summing it over the tokens of rank r gives r's share of the update. Ranks may hold different
    numbers of microbatches (a token budget); ``local`` then divides by each rank's own count.
    """
    validate_plan(plan, len(mask))
    world_size = len(plan)
    lengths = mask.sum(-1)
    counts = simulated_counts(plan, lengths, group_ids, num_groups) if needs_global_counts(denominator) else None
    out = torch.zeros(mask.shape, dtype=dtype)
    for rank in plan:
        for mb in rank:  # A is this rank's own count: only `local` reads it (a budget makes it differ)
            out[mb] = token_weights(
                mask[mb], group_ids[mb], denominator, counts, world_size=world_size, accum_steps=len(rank), dtype=dtype
            )
    return out


def simulated_gradient(
    per_token_loss: Callable[[Tensor], Tensor],
    params: Sequence[Tensor],
    mask: Tensor,
    group_ids: Tensor,
    num_groups: int,
    denominator: Denominator,
    plan: Plan,
) -> list[Tensor]:
    """The gradient of one optimizer step as W DDP ranks with A accumulation steps compute it.

    ``per_token_loss(idx)`` returns the loss l (n, T) of the sequences ``idx``; ``mask`` (S, T) is
    the response mask of the whole minibatch.
    """
    validate_plan(plan, len(mask))
    world_size = len(plan)
    lengths = mask.sum(-1)
    counts = simulated_counts(plan, lengths, group_ids, num_groups) if needs_global_counts(denominator) else None
    params = list(params)
    reduced = [torch.zeros_like(p) for p in params]
    for rank in plan:
        rank_grad = [torch.zeros_like(p) for p in params]
        for mb in rank:  # gradient accumulation: microbatch gradients add up
            loss, _ = microbatch_loss(per_token_loss(mb), mask[mb], group_ids[mb], denominator, counts,
                                      world_size=world_size, accum_steps=len(rank))
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            for acc, g in zip(rank_grad, grads):
                if g is not None:
                    acc += g
        for acc, g in zip(reduced, rank_grad):
            acc += g
    return [g / world_size for g in reduced]  # DDP's mean over ranks
