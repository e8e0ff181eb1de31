"""Importance sampling against the rollout engine: the trainer's probabilities over the engine's.

A rollout engine (vLLM) samples token t of sequence i from its own copy of the weights, with its
own kernels, so its probability pi_engine differs a little from the trainer's pi_old at the same
weights (at fp32 and a correct sync, by rounding; at bf16 or a stale sync, by much more). The
policy gradient is an expectation under pi_old, so each token's loss may be reweighted by

    rho_t = pi_old(o_t) / pi_engine(o_t) = exp(logp_old - logp_engine)

and the weight bounded, since a rare token the engine under-sampled can make rho huge:

    truncate   the policy-gradient loss of every token times min(rho_t, cap); a capped token stays in
               the loss and in every count (truncated importance sampling)
    mask       tokens with rho_t outside [1 / cap, cap] leave the loss and every count: the loss is
               normalized over the tokens it keeps, as the audit's ``rejected`` tokens should be
               (``gradnorm.audit.masking``), so a dropped token does not dilute the others' weight

The weights are constants (no gradient flows through them), computed once per rollout batch from
the trainer's own scores, never from the engine's alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

Correction = Literal["none", "truncate", "mask"]
CORRECTIONS: tuple[str, ...] = get_args(Correction)


@dataclass(frozen=True)
class EngineCorrection:
    """What the correction does to one rollout batch's response tokens (S, R)."""

    kept: Tensor
    """(S, R) bool: the tokens the loss and the counts take (the response mask, less those ``mask`` drops)."""
    weight: Tensor | None
    """(S, R) float32: the policy-gradient loss's factor min(rho, cap) (``truncate``), else None."""
    capped: Tensor
    """(S, R) bool: response tokens whose weight the cap lowered (``truncate``)."""
    dropped: Tensor
    """(S, R) bool: response tokens the correction dropped (``mask``)."""


def engine_ratio(trainer_logp: Tensor, engine_logp: Tensor) -> Tensor:
    """rho (S, R) float32: exp(trainer - engine) of each sampled token (meaningful on the response mask)."""
    return (trainer_logp.float() - engine_logp.float()).exp()


def correct(trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor, kind: str, cap: float) -> EngineCorrection:
    """The correction ``kind`` of a batch: ``trainer_logp``, ``engine_logp`` (S, R) log-probs of the
    sampled tokens, ``mask`` (S, R) bool the response tokens, ``cap`` > 1 the bound on rho."""
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown correction {kind!r}: expected one of {', '.join(CORRECTIONS)}")
    if not cap > 1:
        raise ValueError(f"the cap on the importance ratio must be above 1, not {cap}")
    none = torch.zeros_like(mask)
    if kind == "none":
        return EngineCorrection(kept=mask, weight=None, capped=none, dropped=none)
    rho = engine_ratio(trainer_logp, engine_logp)
    if kind == "truncate":
        return EngineCorrection(kept=mask, weight=rho.clamp(max=cap).where(mask, torch.zeros_like(rho)),
                                capped=mask & (rho > cap), dropped=none)
    dropped = mask & ((rho > cap) | (rho < 1 / cap))
    return EngineCorrection(kept=mask & ~dropped, weight=None, capped=none, dropped=dropped)
