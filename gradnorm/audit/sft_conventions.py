"""SFT conventions, each a loss (or a rank's step) that ``gradnorm.audit --objective sft`` audits.

Written from the published formulas, never from any project's code. A loss takes one microbatch's
log-probs of its labels ``logp`` (n, T) and the label mask ``mask`` (n, T) (``labels != -100``),
plus, by keyword name, the global counts a fixed trainer passes in; a step takes a rank's
microbatches and calls backward itself (``gradnorm.audit.measurement``). The weight each gives a
label token in J, the minibatch's cross-entropy:

    model_loss_under_accelerate      1 / (G * W * n[r, m])   the model's own ``outputs.loss`` (the
                                                             microbatch's token mean), divided by G
                                                             by accelerate's accumulation (open-
                                                             instruct finetune.py; ``local``)
    model_drops_loss_kwargs          1 / (A * W * n[r, m])   the same as a microbatch loss: a model
                                                             that ignores ``num_items_in_batch`` under
                                                             the transformers Trainer (``local``)
    token_sum_over_num_items         1 / N                   the transformers Trainer and TRL's
                                                             SFTTrainer with ``num_items_in_batch``
                                                             counted over every device (``token``)
    sequence_mean_over_sequences     1 / (S * |y_i|)         each sequence's mean, averaged over the
                                                             minibatch's sequences (``sequence``)
    token_sum                        1                       a sum loss (``constant`` C = 1)
"""

from __future__ import annotations

import torch
from torch import Tensor


def _nll(logp: Tensor, mask: Tensor) -> Tensor:
    """-log p * M (n, T): zero outside the labels (where, not *, so no padding value leaks)."""
    return torch.where(mask, -logp, 0.0)


def model_loss_under_accelerate(microbatches):
    """A rank's step: the model's loss (the microbatch's label-token mean) over G, backward per microbatch.

    accelerate's accumulation divides each microbatch's loss by the G microbatches of the step
    (open-instruct ``finetune.py``, commit e6c3044); DDP then averages over ranks.
    """
    G = len(microbatches)
    for mb in microbatches:
        loss = _nll(mb["logp"], mb["mask"]).sum() / mb["mask"].sum().clamp(min=1)
        (loss / G).backward()


def model_drops_loss_kwargs(logp, mask, *, accum_steps):
    """A model that ignores ``num_items_in_batch`` returns its own token mean; the Trainer then divides by A."""
    return _nll(logp, mask).sum() / mask.sum().clamp(min=1) / accum_steps


def token_sum_over_num_items(logp, mask, *, num_tokens, world_size):
    """The label tokens' sum over ``num_items_in_batch`` (every device's), times the processes W."""
    return _nll(logp, mask).sum() / num_tokens * world_size


def sequence_mean_over_sequences(logp, mask, *, num_sequences, world_size):
    """Each sequence's mean over its labels, summed, over the minibatch's S sequences (times W)."""
    means = _nll(logp, mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return means.sum() / num_sequences * world_size


def token_sum(logp, mask, *, world_size):
    """The label tokens' sum (C = 1), times W so DDP's mean leaves the sum over every rank."""
    return _nll(logp, mask).sum() * world_size


CATALOGUE = {fn.__name__: fn for fn in (model_loss_under_accelerate, model_drops_loss_kwargs, token_sum_over_num_items,
                                        sequence_mean_over_sequences, token_sum)}
"""Every convention above by name, in the order of the module docstring."""

FLAGS = {name: ("--objective", "sft") for name in CATALOGUE} | {
    "model_loss_under_accelerate": ("--objective", "sft", "--step")}
"""The flags each convention is audited with."""
