"""transformers' ``Trainer``: every label token weighs 1/N, N the step's labels over every rank and microbatch.

The Trainer counts the labels of the whole optimizer step (its ``num_items_in_batch``: every
microbatch of the step, all-reduced over ranks when ``average_tokens_across_devices`` is on, the
default) and hands the count to the model's forward, if the forward takes ``**kwargs``. A model
that takes them and drops them returns its own microbatch mean, and the Trainer, believing the
model divided by the global count, neither divides by the accumulation steps nor leaves DDP's mean
alone: every token then weighs 1/N[r,m] (a microbatch's own count), W*A times too much in total.
``compute_loss_func`` is the Trainer's own place for a loss, called with the model's outputs, the
labels and ``num_items_in_batch``; this one sums the token losses and divides by that count, so the
model's own loss is never used:

    from gradnorm.integrations.hf_trainer import global_token_loss
    trainer = Trainer(model=model, args=args, ..., compute_loss_func=global_token_loss)

The Trainer multiplies the result by the world size under DDP (undoing DDP's mean, as gradnorm's
``rank_weights`` does) and adds the microbatches up, so J = sum over the step of nll / N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TESTED = {"transformers": ("5.25.0",), "accelerate": ("1.16.0",)}
"""Versions whose Trainer the trainer audit measured with this loss (tests/e2e/test_trainer_audit.py)."""

IGNORE = -100  # the label the collators put on padding and prompts


def global_token_loss(outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """sum of every label token's cross-entropy / N, N the step's label count (the Trainer's num_items_in_batch).

    ``labels`` (n, T) as the model takes them: position t's label is predicted from position t - 1.
    Without a count (a Trainer that passes none) it refuses, rather than fall back to a
    microbatch mean that would bring the skew back.
    """
    if num_items_in_batch is None:
        raise ValueError("global_token_loss needs the Trainer's num_items_in_batch (transformers >= 4.46 passes it "
                         "to compute_loss_func): without it the loss would be a microbatch mean")
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]  # (n, T, V)
    shift_logits, shift_labels = logits[:, :-1].float(), labels[:, 1:].to(logits.device)  # position t predicts t + 1
    nll = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
                          ignore_index=IGNORE, reduction="sum")
    return nll / torch.as_tensor(num_items_in_batch, device=nll.device, dtype=nll.dtype)
