"""One rank's share of one optimizer step: count, all-reduce once, then accumulate gradients.

This is the loop every data-parallel GRPO trainer runs, with the normalization made explicit:

    1. count the rank's response tokens (all its microbatches) into a small int64 vector;
    2. ONE all-reduce of that vector gives the global counts (skipped by ``local``, which needs none);
    3. for each microbatch: per-token weights w from the global counts, scale by W to undo DDP's
       mean, backpropagate sum(W * w * l); DDP's ``no_sync`` (FSDP2's
       ``set_requires_gradient_sync(False)``) keeps all but the last microbatch from
       communicating, so gradients really add up over accumulation steps.

The caller then clips and steps the optimizer. The real trainer and the multi-process tests both
call ``accumulate_gradients``, so what the tests prove is what the trainer runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from gradnorm.denominators import Counts, Denominator, count_tokens, needs_global_counts, rank_weights, token_weights
from gradnorm.grpo import TokenLosses, stat_sums
from gradnorm.dist.comm import global_counts


def _no_sync(model: nn.Module, last: bool):
    # Only the last microbatch's backward may trigger the gradient reduction; the others just add
    # into .grad. DDP (and FSDP1) have a no_sync() context; FSDP2 has a switch instead, set for
    # every microbatch so that it is left on after the last. Plain modules accumulate as they are.
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def accumulate_gradients(
    model: nn.Module,
    microbatches: Sequence[Tensor],
    mask: Tensor,
    group_ids: Tensor,
    num_groups: int,
    denominator: Denominator,
    token_losses: Callable[[Tensor], TokenLosses],
    world_size: int,
    grad_reduction: str = "mean",
) -> tuple[Counts | None, Tensor]:
    """Backpropagate this rank's microbatches; return (global counts, local stat sums (6,)).

    ``microbatches[m]`` indexes this rank's sequences in ``mask`` (S, T) and ``group_ids`` (S,);
    ``token_losses(idx)`` runs the forward pass for those sequences. Every rank must call this
    with the same number of microbatches, even when it holds no tokens.
    """
    accum_steps = len(microbatches)
    device = mask.device
    counts = None
    if needs_global_counts(denominator):
        rank_idx = torch.cat(list(microbatches)) if microbatches else torch.zeros(0, dtype=torch.long)
        local = count_tokens(mask[rank_idx].sum(-1), group_ids[rank_idx], num_groups)
        counts = global_counts(local.to(device))  # the one extra collective of this minibatch
    sums = torch.zeros(6, dtype=torch.float64, device=device)
    for m, mb in enumerate(microbatches):
        mb_mask = mask[mb]
        with _no_sync(model, last=m == accum_steps - 1):
            terms = token_losses(mb)
            w = token_weights(
                mb_mask, group_ids[mb], denominator, counts,
                world_size=world_size, accum_steps=accum_steps, dtype=terms.loss.dtype,
            )
            loss = (rank_weights(w, world_size, grad_reduction) * torch.where(mb_mask, terms.loss, 0.0)).sum()
            loss.backward()
        sums += stat_sums(w, mb_mask, terms)
    return counts, sums
