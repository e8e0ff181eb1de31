"""Tokens a trainer generates but may not count: truncated responses and rejection-masked tokens.

Two kinds of generated token are often left out of the loss, and their count out of its
denominator, or not:

    truncated   a response cut at max_new_tokens, with no end of sequence (DAPO's overlong
                filtering drops the whole response)
    rejected    a token an importance-sampling rejection mask drops (the rollout engine's and
                the trainer's probabilities disagree beyond a bound)

The user declares which kinds the loss should count (``COUNT_MASKED``); ``mask`` of the batch is
then what should be counted and ``response`` every generated token. A loss that weighs a dropped
token leaks (weight outside the mask). A loss that drops them from its sum but not from its
denominator weighs every kept token too little, by a factor that moves with the share of dropped
tokens in the batch: ``finding`` says which of the two denominators the weights fit, and by how
much a kept token's weight differs from the right one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
from torch import Tensor

CountMasked = Literal["none", "truncated", "rejected", "all"]
COUNT_MASKED: tuple[str, ...] = get_args(CountMasked)
REJECT_RATE = 0.1
"""The share of generated tokens the synthetic rejection mask drops."""


def with_masked_tokens(batch, count: str, seed: int = 0):
    """``batch`` (a ``synthetic.SyntheticBatch``) with one truncated response a group and rejected tokens.

    The longest response of each group runs to the limit T and is marked truncated; each generated
    token is rejected with probability ``REJECT_RATE`` (a generator of its own, seeded by ``seed``).
    ``mask`` keeps the generated tokens of the kinds ``count`` names, and every other generated token.
    """
    if count not in COUNT_MASKED:
        raise ValueError(f"unknown kind {count!r}: expected one of {', '.join(COUNT_MASKED)}")
    S, T = batch.mask.shape
    lengths = batch.mask.sum(-1).clone()  # (S,)
    longest = lengths.view(-1, batch.group_size).argmax(-1) + torch.arange(batch.num_groups) * batch.group_size
    lengths[longest] = T
    truncated = torch.zeros(S, dtype=torch.bool)
    truncated[longest] = True
    response = torch.arange(T) < lengths.unsqueeze(-1)  # (S, T) every generated token
    gen = torch.Generator().manual_seed(seed + 1)
    rejected = response & (torch.rand(S, T, generator=gen, dtype=torch.float64) < REJECT_RATE)  # (S, T)
    mask = response.clone()
    if count not in ("truncated", "all"):
        mask &= ~truncated.unsqueeze(-1)
    if count not in ("rejected", "all"):
        mask &= ~rejected
    return replace(batch, mask=mask, response=response, truncated=truncated, rejected=rejected, count_masked=count)


@dataclass(frozen=True)
class MaskedFinding:
    """What the loss's denominator does with the tokens declared dropped."""

    response_tokens: int  # every generated token
    kept_tokens: int  # N: those the loss should count
    truncated_tokens: int  # dropped with a truncated response
    rejected_tokens: int  # dropped by the rejection mask (and not already with a truncated response)
    counts_dropped: bool | None  # True: the denominator counts them; False: it leaves them out; None: neither fits
    mode: str | None  # the mode whose weights fit (with or without the dropped tokens in its counts)
    ratio: tuple[float, float]  # a kept token's weight over the right one, least and most (1, 1 when right)

    @property
    def dropped_tokens(self) -> int:
        return self.response_tokens - self.kept_tokens


def finding(batch, weights: Tensor, right: dict[str, Tensor], counting: dict[str, Tensor],
            tol: float) -> MaskedFinding:
    """Fit the kept tokens' weights to each mode counted on ``mask`` (right) and on ``response`` (counting).

    ``right[mode]``, ``counting[mode]``: (S, T) the mode's weights with counts over the kept tokens,
    and over every generated token; only the kept tokens are compared.
    """
    kept = batch.mask
    dropped = batch.response & ~kept
    truncated = int((dropped & batch.truncated.unsqueeze(-1)).sum())
    counts_dropped, mode, ratio = None, None, (1.0, 1.0)
    w = weights[kept]
    for name in right:
        good, bad = right[name][kept], counting[name][kept]
        scale = good.abs().max()
        if scale == 0:
            continue
        if (w - good).abs().max() <= tol * scale:
            counts_dropped, mode = False, name
            break
        if (w - bad).abs().max() <= tol * scale and (bad - good).abs().max() > tol * scale:
            ratios = bad[good != 0] / good[good != 0]
            counts_dropped, mode, ratio = True, name, (float(ratios.min()), float(ratios.max()))
            break
    return MaskedFinding(int(batch.response.sum()), int(kept.sum()), truncated, int(dropped.sum()) - truncated,
                         counts_dropped, mode, ratio)
