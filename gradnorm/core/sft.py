"""SFT: the cross-entropy of the label tokens, weighted per token like GRPO's loss.

Supervised fine-tuning minimizes, over the label tokens of one optimizer step's minibatch B,

    J = sum_{i,t} w[i, t] * (-log p_theta(y[i, t])) * M[i, t]

with ``M`` the label mask (``labels != -100``). It is GRPO's objective with the per-token loss
``l = -log p`` in place of the surrogate, so the weights are the same table
(``gradnorm.core.denominators``) with one row less, since SFT has no prompt groups:

    mode        w[i, t]                     what it means
    local       1 / (W * A * N[r, m])       the model's own ``outputs.loss`` (the microbatch's token
                                            mean) divided by A, then DDP's mean: the old bug
    token       1 / N                       the mean over every label token of B: the fix
    sequence    1 / (S_tok * |y_i|)         the mean over sequences of per-sequence means
    C > 0       1 / C                       the token sum over a constant (a sum loss when C = 1)

N counts the label tokens of B over every rank and microbatch: ``count_labels`` per rank, summed
by ONE all-reduce, exactly as GRPO's counts are (``[N, S_tok]`` is the head of GRPO's count
vector: ``Counts.from_vector`` reads it as counts with no groups).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gradnorm.core.denominators import Denominator, loss_weights, parse_denominator

SFT_MODES: tuple[str, ...] = ("local", "token", "sequence")
"""The SFT denominators by name; a positive number is a constant C."""

IGNORE_INDEX = -100
"""The label that marks a position as no label token (PyTorch's and Hugging Face's convention)."""


def parse_sft_denominator(value: object) -> Denominator:
    """A mode of ``SFT_MODES`` or a constant C; "group" is refused, since SFT data has no prompt groups."""
    if value == "group":
        raise ValueError('loss denominator "group" needs prompt groups, which SFT data has none of: '
                         f'expected one of {", ".join(SFT_MODES)} or a positive number')
    return parse_denominator(value)


def count_labels(mask: Tensor) -> Tensor:
    """int64 ``[N, S_tok]``: the label tokens of one rank's microbatches (stacked rows) and the rows with one.

    Counts add up: one all-reduce of this vector over ranks gives the counts of the whole step.
    """
    lengths = mask.sum(-1).to(torch.int64)
    return torch.stack([lengths.sum(), (lengths > 0).sum()])


def label_logprobs(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """(log p(labels) (n, T), mask (n, T) bool) from logits (n, T, V) and labels (n, T) aligned with them.

    The caller shifts (labels[t] is the token after position t). Ignored positions get log-prob 0
    and mask False, so no padding token's value can reach the loss.
    """
    mask = labels != ignore_index
    logp = -F.cross_entropy(logits.flatten(0, 1), labels.masked_fill(~mask, 0).flatten(), reduction="none")
    return torch.where(mask, logp.view_as(labels).to(logits.dtype), 0.0), mask


def sft_weights(mask: Tensor, denominator: Denominator | str, *, world_size: int, accum_steps: int = 1,
                num_tokens: int | None = None, num_sequences: int | None = None,
                dtype: torch.dtype = torch.float32) -> Tensor:
    """w (n, T): each label token's weight in J for one microbatch, from the step's global counts.

    ``num_tokens`` N and ``num_sequences`` S_tok are the sums of ``count_labels`` over every rank and
    microbatch; ``local`` needs neither. A rank backpropagates ``-(world_size * w * logp).sum()``:
    the factor W undoes DDP's mean over ranks (``gradnorm.core.denominators.rank_weights``).
    """
    return loss_weights(mask, parse_sft_denominator(denominator), world_size=world_size, accum_steps=accum_steps,
                        num_tokens=num_tokens, num_sequences=num_sequences, dtype=dtype)
