"""DPO-family conventions, each a loss (or a rank's step) that ``gradnorm.audit --objective dpo`` audits.

Written from the published formulas, never from any project's code. A loss takes one
microbatch's n pairs: the per-token log-probs of the chosen and rejected responses under the
policy and the reference, (n, T) each, and their masks, plus, by keyword name, ``num_pairs``,
``beta`` and the split's ``world_size`` and ``accum_steps``. With l_p = -log sigmoid(beta * m_p)
(``gradnorm.core.pairs.dpo_losses``), the weight each gives a pair in J:

    pair_mean_per_microbatch       1 / (G * W * P[r, m])       ``losses.mean()`` per microbatch
                                                               under accelerate (open-instruct
                                                               dpo_tune_cache.py; TRL's DPOTrainer):
                                                               exact only when every microbatch
                                                               holds the same number of pairs
    token_share_of_pair_means      T_mb / (T_r * P[r,m] * W)   each microbatch's pair mean times its
                                                               share of the rank's tokens (OLMo-core's
                                                               train module under open-instruct
                                                               dpo.py): neither a pair nor a token mean
    pair_sum_over_global_pairs     1 / P                       the fix (``pair``)
    normalized_pair_mean_per_microbatch  1 / (G W P[r,m] |y|)  length-normalized DPO (``dpo_norm``)
                                                               per microbatch (``local normalized``)
    simpo_pair_mean_per_microbatch 2 sigmoid(gamma) beta_s / beta x the above: SimPO, no reference,
                                                               a margin gamma (``local normalized``
                                                               up to that factor)

At the audit's point every margin is 0 and each pair's slope is -beta/2 (the audit's ``--beta``);
a loss with another beta, or a margin gamma, reads as a uniform factor on every weight.
"""

from __future__ import annotations

import torch

from gradnorm.core.pairs import dpo_losses, response_logps


def _losses(c, r, rc, rr, cm, rm, beta, length_normalized=False):
    return dpo_losses(c, r, rc, rr, cm, rm, beta=beta, length_normalized=length_normalized)  # (n,)


def pair_mean_per_microbatch(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask,
                             rejected_mask, *, beta, accum_steps):
    """The microbatch's mean over its pairs, divided by the G = A microbatches of the step."""
    losses = _losses(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask, rejected_mask, beta)
    return losses.mean() / accum_steps


def token_share_of_pair_means(microbatches):
    """A rank's step: each microbatch's pair mean times T_mb / T_rank (its share of the rank's tokens).

    T counts both responses' tokens. No count crosses ranks; DDP then averages over them.
    """
    tokens = [int(mb["chosen_mask"].sum() + mb["rejected_mask"].sum()) for mb in microbatches]
    for mb, t in zip(microbatches, tokens):
        losses = _losses(mb["chosen_logp"], mb["rejected_logp"], mb["ref_chosen_logp"], mb["ref_rejected_logp"],
                         mb["chosen_mask"], mb["rejected_mask"], mb["beta"])
        (losses.mean() * t / sum(tokens)).backward()


def pair_sum_over_global_pairs(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask,
                               rejected_mask, *, beta, num_pairs, world_size):
    """The fix: the microbatch's pair losses summed, over the step's P pairs, times W (DDP's mean undone)."""
    losses = _losses(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask, rejected_mask, beta)
    return losses.sum() / num_pairs * world_size


def normalized_pair_mean_per_microbatch(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask,
                                        rejected_mask, *, beta, accum_steps):
    """Length-normalized DPO: margins from mean token log-probs; the microbatch's pair mean over A."""
    losses = _losses(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask, rejected_mask, beta,
                     length_normalized=True)
    return losses.mean() / accum_steps


SIMPO_BETA, SIMPO_GAMMA = 2.0, 1.0
"""SimPO's beta and target margin gamma (the paper's gamma / beta = 0.5)."""


def simpo_pair_mean_per_microbatch(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_mask,
                                   rejected_mask, *, accum_steps):
    """SimPO: -log sigmoid(beta_s * (mean log pi(y+) - mean log pi(y-)) - gamma), no reference; pair mean over A.

    At the audit's point the margin is -gamma, where the slope is beta_s * sigmoid(gamma): every
    weight reads 2 sigmoid(gamma) beta_s / beta times ``local normalized``'s.
    """
    chosen = response_logps(chosen_logp, chosen_mask, length_normalized=True)
    rejected = response_logps(rejected_logp, rejected_mask, length_normalized=True)
    losses = -torch.nn.functional.logsigmoid(SIMPO_BETA * (chosen - rejected) - SIMPO_GAMMA)
    return losses.mean() / accum_steps


CATALOGUE = {fn.__name__: fn for fn in (pair_mean_per_microbatch, token_share_of_pair_means, pair_sum_over_global_pairs,
                                        normalized_pair_mean_per_microbatch, simpo_pair_mean_per_microbatch)}
"""Every convention above by name, in the order of the module docstring."""

BUDGET = ("--microbatch-tokens", "160")
"""A token budget (2.5 x the longest response): microbatches then hold different numbers of pairs."""

FLAGS = {name: ("--objective", "dpo", *BUDGET) for name in CATALOGUE} | {
    "token_share_of_pair_means": ("--objective", "dpo", "--step")}
"""The flags each convention is audited with."""
