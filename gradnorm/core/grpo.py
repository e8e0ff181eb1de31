"""GRPO loss pieces, pure tensor functions (no torch.distributed, no normalization).

A GRPO step samples G completions o_1..o_G for each prompt q, scores them with a reward r_i and
optimizes, token by token,

    l[i, t] = -min(rho[i, t] * A_i, clip(rho[i, t], 1 - eps_low, 1 + eps_high) * A_i)
              + beta * KL_hat[i, t]

with rho = pi_theta / pi_old the importance ratio, A_i the group-normalized advantage and KL_hat a
per-token estimate of KL(pi_theta || pi_ref). How those per-token losses are *averaged* is not
decided here: that is the job of ``gradnorm.core.denominators`` (a per-token weight).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + eps), one advantage per sequence (S,).

    ``rewards`` (S,) hold num_groups consecutive groups of ``group_size`` completions of the same
    prompt. ``std_g`` is the Bessel-corrected std of the group, as in DeepSeekMath's GRPO.
    ``scale_by_std=False`` keeps only the centring, as Dr GRPO recommends: dividing by the std
    up-weights prompts that are nearly always right or nearly always wrong.
    """
    if group_size < 2:
        raise ValueError(f"group advantages need at least 2 completions per prompt, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.reshape(-1, group_size)  # (num_groups, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float = 0.2, clip_high: float = 0.2
) -> tuple[Tensor, Tensor]:
    """PPO's clipped policy-gradient loss per token, with separate low and high clip ranges.

    ``logp``, ``old_logp``: (S, T) log-probs of the sampled tokens under pi_theta and pi_old;
    ``advantages``: (S,). DAPO's clip-higher uses clip_low=0.2, clip_high=0.28 so that unlikely
    tokens with positive advantage can still grow. Returns (loss (S, T), clipped (S, T) bool),
    where ``clipped`` marks tokens whose gradient the clip switched off.
    """
    ratio = torch.exp(logp - old_logp)  # (S, T) rho
    adv = advantages.unsqueeze(-1)  # (S, 1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    return loss, clipped < unclipped


# KL estimators (Schulman, "Approximating KL divergence", 2020). With x ~ pi_theta and
# log_ratio = log pi_ref(x) - log pi_theta(x), each is a per-sample estimate of KL(pi_theta || pi_ref):
def _k1(log_ratio: Tensor) -> Tensor:
    # -log(r): unbiased, but high variance and can be negative.
    return -log_ratio


def _k2(log_ratio: Tensor) -> Tensor:
    # (log r)^2 / 2: biased, low variance, non-negative; its gradient is that of the true KL's
    # second-order expansion.
    return 0.5 * log_ratio**2


def _k3(log_ratio: Tensor) -> Tensor:
    # (r - 1) - log r: unbiased and non-negative (r - 1 is a zero-mean control variate). GRPO's choice.
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from the sampled tokens' log-probs, (S, T)."""
    try:
        fn = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r}: expected one of {sorted(KL_ESTIMATORS)}") from None
    return fn(ref_logp - logp)


def entropy_from_logprobs(logp: Tensor) -> Tensor:
    """H = -sum_v p_v log p_v per position, from log-probabilities (..., V) -> (...)."""
    return -(logp.exp() * logp).sum(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H per position from logits (..., V) -> (...), computed in float32 or wider."""
    low_precision = logits.dtype in (torch.float16, torch.bfloat16)
    return entropy_from_logprobs(torch.log_softmax(logits.float() if low_precision else logits, dim=-1))


# ---------------------------------------------------------------------------------------------
# Statistics: global and token-weighted, so that they compare across W and A.
# ---------------------------------------------------------------------------------------------

STAT_NAMES = ("loss", "tokens", "pg_loss", "kl", "clipfrac", "entropy")
NUM_STATS = len(STAT_NAMES)


def stat_sums(weights: Tensor, mask: Tensor, terms: "TokenLosses") -> Tensor:
    """Sums over one microbatch that add up across microbatches and ranks, float64 (6,).

    The first entry sums w * l: summed over B it is J itself, the objective being minimized.
    The others are plain token sums; dividing them by the global token count
    (``finalize_stats``) turns them into token means over B, comparable across W and A.
    """

    def masked_sum(x: Tensor | None) -> Tensor:
        if x is None:
            return torch.zeros((), dtype=torch.float64, device=mask.device)
        return torch.where(mask, x.detach().to(torch.float64), 0.0).sum()

    objective = (weights.detach().to(torch.float64) * torch.where(mask, terms.loss.detach().to(torch.float64), 0.0)).sum()
    return torch.stack(
        [
            objective,
            mask.sum().to(torch.float64),
            masked_sum(terms.pg_loss),
            masked_sum(terms.kl),
            masked_sum(terms.clipped),
            masked_sum(terms.entropy),
        ]
    )


def finalize_stats(sums: Tensor, with_kl: bool = True) -> dict[str, float]:
    """Turn globally summed ``stat_sums`` into the logged values (token means over B)."""
    values = dict(zip(STAT_NAMES, sums.tolist()))
    tokens = values.pop("tokens")
    out = {"loss": values.pop("loss"), "tokens": int(tokens)}
    for name, total in values.items():
        if name == "kl" and not with_kl:
            continue
        out[name] = total / tokens if tokens > 0 else 0.0
    return out


# ---------------------------------------------------------------------------------------------
# Everything one microbatch contributes, per token.
# ---------------------------------------------------------------------------------------------


@dataclass
class TokenLosses:
    """Per-token terms of one microbatch, each (n, T)."""

    loss: Tensor
    """l = pg_loss + beta * kl: the differentiable per-token loss that the weights average."""
    pg_loss: Tensor
    """The clipped surrogate term."""
    clipped: Tensor
    """bool: tokens whose gradient the clip switched off."""
    kl: Tensor | None = None
    """KL estimate, or None when beta = 0 (no reference policy is loaded then)."""
    entropy: Tensor | None = None
    """Entropy of pi_theta at each position, for logging only."""


def grpo_token_losses(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_estimator: str = "k3",
    entropy: Tensor | None = None,
    importance_weight: Tensor | None = None,
) -> TokenLosses:
    """The GRPO per-token loss l = clipped surrogate + beta * KL_hat, with its parts for logging.

    With ``beta == 0`` no KL is computed and ``ref_logp`` may be None: a run without a reference
    policy must not touch one (a crash the field has seen when statistics assumed it existed).
    ``importance_weight`` (S, T), a constant: each token's surrogate times it (truncated importance
    sampling against a rollout engine, ``gradnorm.core.importance``); the KL term is not reweighted.
    """
    pg_loss, clipped = clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high)
    if importance_weight is not None:
        pg_loss = pg_loss * importance_weight.detach()
    if beta == 0.0:
        return TokenLosses(loss=pg_loss, pg_loss=pg_loss, clipped=clipped, kl=None, entropy=entropy)
    if ref_logp is None:
        raise ValueError(f"beta = {beta} needs reference log-probs; pass ref_logp or set beta = 0")
    kl = kl_estimate(logp, ref_logp, kl_estimator)
    return TokenLosses(loss=pg_loss + beta * kl, pg_loss=pg_loss, clipped=clipped, kl=kl, entropy=entropy)
