"""DPO and its family: one loss per preference pair, weighted per pair.

A DPO step minimizes, over the P preference pairs of one optimizer step's minibatch B,

    J = sum_p v_p * l_p,    l_p = -log sigmoid(beta * m_p)
    m_p = (log pi_theta - log pi_ref)(y+_p) - (log pi_theta - log pi_ref)(y-_p)

where log pi(y) is a response's summed token log-probs, or their mean over its |y| tokens in the
length-normalized variants (``length_normalized=True``; SimPO also drops the reference and
subtracts a margin gamma). The unit averaged over is the pair, so the pair weight v_p plays the
part the token weight plays in GRPO and SFT:

    mode        v_p                         what it means
    local       1 / (W * A * P[r, m])       ``losses.mean()`` per microbatch, divided by A, then
                                            DDP's mean: exact only when every microbatch holds the
                                            same number of pairs (a token budget breaks that)
    pair        1 / P                       the mean over every pair of B: the fix
    C > 0       1 / C                       the pair sum over a constant

P counts the pairs of B over every rank and microbatch (``count_pairs`` per rank, ONE all-reduce).
Through the margin, each token of a pair weighs v_p (summed log-probs) or v_p / |y| (mean
log-probs): length normalization is a choice of the margin, made per response, and is the same
under any split, so it never needs a count of its own.
"""

from __future__ import annotations

from typing import Literal, Union, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from gradnorm.core.denominators import parse_denominator

PairMode = Literal["local", "pair"]
PairDenominator = Union[PairMode, float]
PAIR_MODES: tuple[str, ...] = get_args(PairMode)


def parse_pair_denominator(value: object) -> PairDenominator:
    """A mode of ``PAIR_MODES`` or a positive finite constant C."""
    if value in PAIR_MODES:
        return value  # type: ignore[return-value]
    if isinstance(value, str) and value in ("token", "sequence", "group"):
        raise ValueError(f"loss denominator {value!r} is a token mode; a pair loss takes one of "
                         f"{', '.join(PAIR_MODES)} or a positive number")
    try:
        return parse_denominator(value)
    except ValueError:
        raise ValueError(f"invalid pair denominator {value!r}: expected one of {', '.join(PAIR_MODES)} "
                         "or a positive finite number") from None


def count_pairs(num_pairs: int, device: torch.device | str | None = None) -> Tensor:
    """int64 ``[P_r]``: the pairs of one rank's microbatches. Summed over ranks (one all-reduce): P."""
    return torch.tensor([int(num_pairs)], dtype=torch.int64, device=device)


def pair_weights(mb_pairs: int, denominator: PairDenominator | str, *, world_size: int, accum_steps: int = 1,
                 num_pairs: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> Tensor:
    """v (mb_pairs,): each pair's weight in J for one microbatch of ``mb_pairs`` pairs.

    ``num_pairs`` is P, the all-reduced ``count_pairs``; ``local`` needs none and divides by the
    microbatch's own count instead (the bug, kept to show it). Each weight is 1/den rounded once;
    a rank backpropagates ``(world_size * v * l).sum()``, the factor W undoing DDP's mean.
    """
    denominator = parse_pair_denominator(denominator)
    if denominator == "local":
        den = world_size * accum_steps * mb_pairs  # ALGO LOGIC (the bug): this microbatch's own pair count
    elif denominator == "pair":
        if num_pairs is None:
            raise ValueError('pair denominator "pair" needs num_pairs, the pairs of the whole step')
        den = int(num_pairs)  # ALGO LOGIC (the fix): every pair of the step weighs 1/P
    else:
        return torch.full((mb_pairs,), 1.0, dtype=dtype, device=device) / denominator
    value = 1.0 / torch.tensor(den, dtype=dtype) if den > 0 else torch.zeros((), dtype=dtype)
    return value.to(device).expand(mb_pairs).clone()


def response_logps(logp: Tensor, mask: Tensor, length_normalized: bool = False) -> Tensor:
    """log pi(y) per response (n,): the masked sum of token log-probs (n, T), or their mean over |y|."""
    total = torch.where(mask, logp, 0.0).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if length_normalized else total


def dpo_losses(chosen_logp: Tensor, rejected_logp: Tensor, ref_chosen_logp: Tensor, ref_rejected_logp: Tensor,
               chosen_mask: Tensor, rejected_mask: Tensor, *, beta: float = 0.1,
               length_normalized: bool = False) -> Tensor:
    """l_p = -log sigmoid(beta * m_p) per pair (n,), from token log-probs (n, T) of both responses.

    At pi_theta = pi_ref every margin is 0 and dl_p/dm_p = -beta/2: the point where
    ``gradnorm.audit`` reads a DPO loss's weights.
    """
    chosen = response_logps(chosen_logp - ref_chosen_logp, chosen_mask, length_normalized)
    rejected = response_logps(rejected_logp - ref_rejected_logp, rejected_mask, length_normalized)
    return -F.logsigmoid(beta * (chosen - rejected))
