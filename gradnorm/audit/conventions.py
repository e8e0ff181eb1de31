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

The conventions of the splits beyond (W, A, sharding), each audited with the flags in ``AXES``:

    row_mean_over_packs               1 / (S * |row|)            each packed row taken for one sequence
    sequence_mean_inside_packs        1 / (S * |o_i|)            per sequence by sequence_ids (``sequence``)
    context_parallel_chunk_mean       1 / (W * A * N[r,m,c])     each rank's chunk's own token mean
    pipeline_mean_of_token_means      1 / (W * A * P * N[r,m,p]) a schedule averaging its microbatches' means
    gspo_sequence_ratio               1 / (S * |o_i|)            GSPO on policy (``sequence``)
    cispo_clipped_weight              1 / N                      CISPO on policy (``token``)

An outer-loop error no single microbatch shows, audited across A:

    dapo_generation_window_count      A / (S_gen * N)            the count taken over a generation
                                                                 batch of S_gen microbatches while the
                                                                 step spans A (TRL's ``dapo``, TRL #5619;
                                                                 exact only when A = S_gen)

Under packing ``advantages`` come per token, (n, L), so the helpers below take either shape.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradnorm.core.grpo import clipped_surrogate

DR_GRPO_CONSTANT = 4096.0
"""Dr GRPO's C = sequences per minibatch x max_new_tokens, fixed by the config (64 x 64 here)."""


def _per_token(advantages: Tensor, mask: Tensor) -> Tensor:
    """(n, 1) per row, or (n, L) as given when rows are packed (a sequence's advantage on each of its tokens)."""
    return advantages if advantages.dim() == mask.dim() else advantages.unsqueeze(-1)


def _token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """l * M (n, T): the clipped surrogate, zero outside the response (where, not *, so no NaN leaks)."""
    if advantages.dim() == mask.dim():  # packed: l = -min(rho A, clip(rho) A), written out per token
        ratio = torch.exp(logp - old_logp)
        loss = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    else:
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


def token_sum_over_global_count(logp, old_logp, advantages, mask, *, num_tokens, world_size, context_parallel=1):
    """The fix (DAPO's token-level loss): J = (1/N) sum_{i,t} l M, N over all ranks and microbatches.

    The trainer all-reduces the token count once per minibatch and passes it in; W undoes DDP's mean,
    and K its mean over the K ranks of a context-parallel group (gradients averaged over W x K ranks).
    A chunk, a packed row or a pipeline microbatch only adds its own tokens' terms: N covers them all.
    """
    return _token_loss(logp, old_logp, advantages, mask).sum() / num_tokens * world_size * context_parallel


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


def row_mean_over_packs(logp, old_logp, advantages, mask, *, num_sequences, world_size):
    """J = (1/S) sum_rows (1/|row|) sum_t l M: a per-row mean, right when a row is one sequence.

    On packed rows every token of a row weighs 1 / (S * |row|), |row| the tokens of all the
    responses packed in it: a long response lends its count to the short ones beside it.
    """
    per_row = _token_loss(logp, old_logp, advantages, mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (n,)
    return per_row.sum() / num_sequences * world_size


def sequence_mean_inside_packs(logp, old_logp, advantages, mask, *, sequence_ids, sequence_tokens, num_sequences,
                               world_size, context_parallel=1):
    """J = (1/S) sum_i (1/|o_i|) sum_t l M, each token divided by its own sequence's length.

    ``sequence_ids`` (n, L) says whose token each position is, ``sequence_tokens`` (k,) the whole
    length |o_i|, so the same line holds on packed rows and on a context-parallel chunk.
    """
    own_length = sequence_tokens[sequence_ids.clamp(min=0)].clamp(min=1)  # (n, L) |o_i| of each token's sequence
    terms = _token_loss(logp, old_logp, advantages, mask) / own_length
    return terms.sum() / num_sequences * world_size * context_parallel


def context_parallel_chunk_mean(logp, old_logp, advantages, mask, *, accum_steps, context_parallel):
    """Each rank's token mean over its own chunk, times K to undo the mean over the group, / A.

    Weight 1 / (W * A * N[r, m, c]), N[r, m, c] the response tokens of chunk c of the microbatch:
    the late chunks of short responses hold few tokens, and those shout.
    """
    local = _token_loss(logp, old_logp, advantages, mask).sum() / mask.sum().clamp(min=1)
    return local * context_parallel / accum_steps


def pipeline_mean_of_token_means(logp, old_logp, advantages, mask, *, accum_steps):
    """A pipeline microbatch's token mean, / A; the schedule then averages its P microbatches (x 1/P).

    Weight 1 / (W * A * P * N[r, m, p]): the old per-microbatch mean, one level down.
    """
    return _token_loss(logp, old_logp, advantages, mask).sum() / mask.sum().clamp(min=1) / accum_steps


GSPO_CLIP = (3e-4, 4e-4)
"""GSPO's clip range of the sequence ratio (left, right), far narrower than a token ratio's."""


def gspo_sequence_ratio(logp, old_logp, advantages, mask, *, num_sequences, world_size):
    """GSPO: J = (1/S) sum_i min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i), one ratio a sequence:

        s_i = (pi_theta(o_i) / pi_old(o_i))^(1/|o_i|) = exp((1/|o_i|) sum_t (logp - old_logp) M)

    On policy s_i = 1 and ds_i / dlogp[i, t] = 1/|o_i|: each token weighs 1 / (S * |o_i|), as in
    DeepSeekMath's GRPO (``sequence``); off policy the clip acts on whole sequences.
    """
    log_ratio = torch.where(mask, logp - old_logp, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)  # (n,)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - GSPO_CLIP[0], 1 + GSPO_CLIP[1])
    per_sequence = -torch.minimum(ratio * advantages, clipped * advantages) * (mask.sum(-1) > 0)
    return per_sequence.sum() / num_sequences * world_size


CISPO_EPS_HIGH = 0.28
"""CISPO's upper bound on the IS weight (no lower bound: every token keeps a gradient)."""


def cispo_clipped_weight(logp, old_logp, advantages, mask, *, num_tokens, world_size):
    """CISPO: J = (1/N) sum_{i,t} sg(min(rho, 1 + eps_high)) A_i logp[i, t] M: the clipped IS weight
    is a constant (stop-gradient) and multiplies log pi_theta, so no token's gradient is clipped away.

    On policy the weight is 1 and each token weighs 1/N (``token``).
    """
    weight = torch.exp(logp - old_logp).detach().clamp(max=1 + CISPO_EPS_HIGH)  # sg(clip(rho)) (n, T)
    terms = -weight * _per_token(advantages, mask) * logp
    return torch.where(mask, terms, 0.0).sum() / num_tokens * world_size


STEPS_PER_GENERATION = 4
"""S_gen: the microbatches one generation batch spans, whose tokens ``num_items_in_batch`` counts."""


def dapo_generation_window_count(logp, old_logp, advantages, mask, *, num_tokens, world_size, accum_steps):
    """The token sum over the generation batch's count, times W: right only when the step spans S_gen microbatches.

    ``num_items_in_batch`` counts the completion tokens of the whole generation batch, S_gen
    microbatches of every rank, while the optimizer steps after A of them. On the audit's
    minibatch (every microbatch alike on average) that count is N * S_gen / A, so every weight is
    A / S_gen times the fix's: the step's weights sum to A / S_gen, not 1 (TRL #5619; TRL PR
    #6024 measured 0.5x at S_gen = 4, A = 2).
    """
    generation_tokens = num_tokens * STEPS_PER_GENERATION / accum_steps
    return _token_loss(logp, old_logp, advantages, mask).sum() / generation_tokens * world_size


CATALOGUE = {
    fn.__name__: fn
    for fn in (
        microbatch_token_mean,
        sequence_mean_then_batch_mean,
        token_sum_over_constant,
        token_sum_over_global_count,
        group_mean_then_mean_of_groups,
        microbatch_mean_of_sequence_means,
        row_mean_over_packs,
        sequence_mean_inside_packs,
        context_parallel_chunk_mean,
        pipeline_mean_of_token_means,
        gspo_sequence_ratio,
        cispo_clipped_weight,
        dapo_generation_window_count,
    )
}
"""Every convention above by name, in the order of the module docstring."""

AXES = {
    "row_mean_over_packs": ("--pack", "256"),
    "sequence_mean_inside_packs": ("--pack", "256"),
    "context_parallel_chunk_mean": ("--context-parallel", "2"),
    "pipeline_mean_of_token_means": ("--pipeline-combine", "mean"),
    "dapo_generation_window_count": ("--accum-steps", "2", "8"),  # A != S_gen: at A = S_gen it is exact
}
"""The flags each convention is audited with (the splits it is about); the others take none."""
