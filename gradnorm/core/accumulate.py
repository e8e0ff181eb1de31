"""One rank's share of one optimizer step: backpropagate its microbatches with the global counts.

This is the loop every data-parallel GRPO trainer runs, with the normalization made explicit. The
caller has already

    1. counted the rank's response tokens (all its microbatches) into a small int64 vector
       (``denominators.rank_count_vector``), and
    2. all-reduced that vector ONCE (``dist.comm.global_counts``; skipped by ``local`` and a
       constant, which need no counts),

and passes the global counts in. Here, for each microbatch: per-token weights w from the global
counts, scaled by W to undo DDP's mean, and a backward of sum(W * w * l)
(``denominators.microbatch_loss``). DDP's ``no_sync`` (FSDP2's ``set_requires_gradient_sync``)
keeps all but the last microbatch from communicating, so gradients really add up over the
accumulation steps. The caller then clips and steps the optimizer.

The trainer writes this loop out in its own ``step_gradient`` (gradnorm/train.py), with the
forward, the per-token losses and the weights in sight, and takes only ``no_sync`` from here;
``accumulate_gradients`` is the same loop for a loss given as a function of the rows, which the
teaching harness, the benchmarks and the FSDP2 tests run on the toy problem.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from gradnorm.core.denominators import Counts, Denominator, microbatch_loss
from gradnorm.core.grpo import NUM_STATS, TokenLosses, stat_sums


def no_sync(model: nn.Module, last: bool):
    """The context a microbatch's backward runs in: gradients stay local unless ``last``."""
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
    counts: Counts | None,
    denominator: Denominator,
    token_losses: Callable[[Tensor], TokenLosses],
    world_size: int,
    num_passes: int | None = None,
) -> Tensor:
    """Backpropagate this rank's microbatches; return its local statistic sums (NUM_STATS,) float64.

    ``microbatches[m]`` indexes this rank's sequences in ``mask`` (S, T) and ``group_ids`` (S,);
    ``counts`` are the global counts (None for ``local`` and a constant); ``token_losses(idx)``
    runs the forward pass for those sequences. Every rank must run the same number of passes,
    even when it holds no tokens: ``num_passes`` (default: its own count) is the most microbatches
    any rank holds (``sharding.passes``). A rank with fewer first runs idle passes: one row of the
    minibatch with an all-False mask, so its weight and its gradient are exactly zero while the
    forward and backward still touch every parameter (FSDP2 gathers, DDP's hooks fire). ``local``
    divides by the rank's own microbatch count, as trainers with a token budget did.
    """
    accum_steps = len(microbatches)  # A of this rank: what `local` divides by
    num_passes = accum_steps if num_passes is None else num_passes
    if num_passes < accum_steps:
        raise ValueError(f"num_passes={num_passes} is fewer than this rank's {accum_steps} microbatches")
    filler = microbatches[0][:1] if accum_steps and len(microbatches[0]) else torch.zeros(1, dtype=torch.long)
    idle = [(filler, torch.zeros_like(mask[filler]))] * (num_passes - accum_steps)  # zero weight, same graph
    sums = torch.zeros(NUM_STATS, dtype=torch.float64, device=mask.device)
    for m, (mb, mb_mask) in enumerate(idle + [(mb, mask[mb]) for mb in microbatches]):
        with no_sync(model, last=m == num_passes - 1):
            terms = token_losses(mb)
            loss, w = microbatch_loss(terms.loss, mb_mask, group_ids[mb], denominator, counts,
                                      world_size=world_size, accum_steps=max(accum_steps, 1))
            loss.backward()
        sums += stat_sums(w, mb_mask, terms)
    return sums
