"""A catalogue of loss conventions, each a microbatch loss that ``gradnorm.audit`` can audit.

Each entry is written from its published formula, not copied from any project's code, and follows
the audit's contract (``gradnorm.audit``): it takes one microbatch's per-token ``logp`` (n, T),
``old_logp`` (n, T), ``advantages`` (n,) and response ``mask`` (n, T), plus, by keyword name, the
global counts a fixed trainer passes in, and returns the scalar that the trainer backpropagates.
The audit's default outer loop backpropagates that scalar as returned and lets DDP average the
gradients over W ranks, so every entry carries its own 1/A or W factor, visibly.

All of them average the same per-token loss, the clipped surrogate of ``gradnorm.core.grpo``:

    l[i, t] = -min(rho * A_i, clip(rho, 1 - 0.2, 1 + 0.2) * A_i),    rho = pi_theta / pi_old

and differ only in how they weigh it (the weight each one ends up with, per token, in J):

    microbatch_token_mean             1 / (W * A * N[r, m])     the old behaviour (``local``)
    sequence_mean_then_batch_mean     1 / (S * |o_i|)            DeepSeekMath GRPO (``sequence``)
    token_sum_over_constant           1 / C                      Dr GRPO (a constant)
    token_sum_over_global_count       1 / N                      DAPO, the fix (``token``)
    group_mean_then_mean_of_groups    1 / (N_groups * N_g(i))          per prompt group (``group``)
    microbatch_mean_of_sequence_means 1 / (W * A * n[r,m] * |o_i|)  skewed unless every microbatch
                                                                 holds the same number of sequences
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradnorm.core.grpo import clipped_surrogate

DR_GRPO_CONSTANT = 4096.0
"""Dr GRPO's C = sequences per minibatch x max_new_tokens, fixed by the config (64 x 64 here)."""


def _token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """l * M (n, T): the clipped surrogate, zero outside the response (where, not *, so no NaN leaks)."""
    loss, _ = clipped_surrogate(logp, old_logp, advantages)
    return torch.where(mask, loss, 0.0)


def _sequence_means(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """(1/|o_i|) sum_t l[i, t] M[i, t], one per sequence (n,)."""
    return _token_loss(logp, old_logp, advantages, mask).sum(-1) / mask.sum(-1).clamp(min=1)


def microbatch_token_mean(logp, old_logp, advantages, mask, *, accum_steps):
    """The old behaviour: each microbatch's masked mean, divided by A (DDP then divides by W).

    J_local = (1 / (W*A)) sum_{r,m} (1 / N[r, m]) sum_{(i,t) in (r,m)} l M: a mean of local means.
    """
    return _token_loss(logp, old_logp, advantages, mask).sum() / mask.sum().clamp(min=1) / accum_steps


def sequence_mean_then_batch_mean(logp, old_logp, advantages, mask, *, num_sequences, world_size):
    """DeepSeekMath's GRPO objective: J = (1/S) sum_i (1/|o_i|) sum_t l M, S over the minibatch.

    Each microbatch sums its sequence means and divides by the global S; the factor W undoes
    DDP's mean over ranks, and nothing divides by A (S already counts every microbatch).
    """
    return _sequence_means(logp, old_logp, advantages, mask).sum() / num_sequences * world_size


def token_sum_over_constant(logp, old_logp, advantages, mask, *, world_size):
    """Dr GRPO: J = (1/C) sum_{i,t} l M with a constant C (``DR_GRPO_CONSTANT``); W undoes DDP's mean."""
    return _token_loss(logp, old_logp, advantages, mask).sum() / DR_GRPO_CONSTANT * world_size


def token_sum_over_global_count(logp, old_logp, advantages, mask, *, num_tokens, world_size):
    """The fix (DAPO's token-level loss): J = (1/N) sum_{i,t} l M, N over all ranks and microbatches.

    The trainer all-reduces the token count once per minibatch and passes it in; W undoes DDP's mean.
    """
    return _token_loss(logp, old_logp, advantages, mask).sum() / num_tokens * world_size


def group_mean_then_mean_of_groups(logp, old_logp, advantages, mask, *, num_groups, group_tokens, world_size):
    """J = (1/N_groups) sum_g (1/N_g) sum_{i in g} sum_t l M: every prompt group weighs the same.

    ``group_tokens`` (n,) holds N_g(i), the global token count of each sequence's group.
    """
    per_sequence = _token_loss(logp, old_logp, advantages, mask).sum(-1)  # (n,)
    return (per_sequence / group_tokens.clamp(min=1)).sum() / num_groups * world_size


def microbatch_mean_of_sequence_means(logp, old_logp, advantages, mask, *, accum_steps):
    """A per-microbatch mean of per-sequence means, divided by A (a common "grpo" loss).

    Weight 1 / (W * A * n[r, m] * |o_i|) with n[r, m] the sequences of the microbatch: equal to
    ``sequence`` only when every microbatch holds S / (W*A) sequences, so packing by tokens skews it.
    """
    return _sequence_means(logp, old_logp, advantages, mask).mean() / accum_steps


CATALOGUE = {
    fn.__name__: fn
    for fn in (
        microbatch_token_mean,
        sequence_mean_then_batch_mean,
        token_sum_over_constant,
        token_sum_over_global_count,
        group_mean_then_mean_of_groups,
        microbatch_mean_of_sequence_means,
    )
}
"""Every convention above by name, in the order of the module docstring."""
