"""The synthetic GRPO minibatch every loss is audited on: ragged groups, both signs of advantage.

``synthetic_minibatch`` draws S sequences in groups of G with response lengths log-uniform in
[1, T], so every group is ragged, and advantages of both signs with |A_i| >= 0.1 in every group
(the weights are read off as w = -g / A_i). ``minibatch_size`` is the smallest S that every
layout asked for splits into whole groups. ``gradnorm.audit.masking`` adds the tokens a trainer
generates but may not count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradnorm.core.grpo import group_advantages


@dataclass(frozen=True)
class SyntheticBatch:
    """The synthetic ragged GRPO minibatch every loss is audited on (S sequences, T positions)."""

    logp: Tensor  # (S, T) float64, also on padding, where a loss that ignores the mask reads it
    mask: Tensor  # (S, T) bool, the tokens the loss should count (the first |o_i| positions of each row)
    advantages: Tensor  # (S,) float64, |A_i| >= 0.1, both signs in every group
    group_ids: Tensor  # (S,) int64, consecutive groups of group_size completions
    group_size: int
    response: Tensor | None = None  # (S, T) bool, every generated token (``mask`` unless tokens are dropped)
    truncated: Tensor | None = None  # (S,) bool, responses cut at T (``gradnorm.audit.masking``)
    rejected: Tensor | None = None  # (S, T) bool, tokens a rejection mask drops
    count_masked: str | None = None  # which of those the loss should count; None: the batch has none

    def __post_init__(self):
        if self.response is None:  # no dropped tokens: every generated token counts
            object.__setattr__(self, "response", self.mask)
        if self.truncated is None:
            object.__setattr__(self, "truncated", torch.zeros(len(self.mask), dtype=torch.bool))
        if self.rejected is None:
            object.__setattr__(self, "rejected", torch.zeros_like(self.mask))

    @property
    def num_groups(self) -> int:
        return len(self.mask) // self.group_size


def synthetic_minibatch(num_sequences: int, group_size: int = 8, max_new_tokens: int = 64, seed: int = 0) -> SyntheticBatch:
    """Groups of G completions with lengths log-uniform in [1, T], so every group is ragged."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(num_sequences, generator=gen, dtype=torch.float64)
    lengths = torch.exp(u * math.log(max_new_tokens)).round().long().clamp(1, max_new_tokens)  # (S,)
    logp = -(0.05 + 3.0 * torch.rand(num_sequences, max_new_tokens, generator=gen, dtype=torch.float64))
    adv = group_advantages(torch.rand(num_sequences, generator=gen, dtype=torch.float64), group_size)
    adv = torch.where(adv >= 0, adv.clamp(min=0.1), adv.clamp(max=-0.1))  # nonzero: w = -g / A
    return SyntheticBatch(logp=logp, mask=torch.arange(max_new_tokens) < lengths.unsqueeze(-1), advantages=adv,
                     group_ids=torch.arange(num_sequences) // group_size, group_size=group_size)


def synthetic_pairs(num_pairs: int, max_new_tokens: int = 64, seed: int = 0) -> SyntheticBatch:
    """P preference pairs as 2P rows (pair p: chosen row 2p, rejected row 2p + 1), lengths log-uniform in [1, T].

    Every response token of a pair holds the same log-prob, so a length-normalized margin without
    a reference (SimPO's, gamma = 0) is 0 as well as every margin against a reference equal to the
    policy: the audit's point, where the pair loss's slope is known. Padding holds other values,
    which a loss that ignores the masks reads. ``advantages`` are unused (ones); ``group_ids`` are pairs.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * num_pairs
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    lengths = torch.exp(u * math.log(max_new_tokens)).round().long().clamp(1, max_new_tokens)  # (2P,)
    mask = torch.arange(max_new_tokens) < lengths.unsqueeze(-1)
    level = -(0.05 + 3.0 * torch.rand(num_pairs, generator=gen, dtype=torch.float64)).repeat_interleave(2)  # (2P,)
    padding = -(0.05 + 3.0 * torch.rand(rows, max_new_tokens, generator=gen, dtype=torch.float64))
    logp = torch.where(mask, level.unsqueeze(-1), padding)
    return SyntheticBatch(logp=logp, mask=mask, advantages=torch.ones(rows, dtype=torch.float64),
                          group_ids=torch.arange(rows) // 2, group_size=2)


def minibatch_size(layouts: Sequence[int], group_size: int) -> int:
    """The smallest S that splits into whole groups and every W*A, with >= 2 sequences a microbatch."""
    step = math.lcm(group_size, *layouts)
    return step * math.ceil(max(2 * max(layouts), 2 * group_size) / step)
