"""An accelerate loop: every label token weighs 1/N, N the step's labels over every rank and microbatch.

The finetune pattern ``with accelerator.accumulate(model): accelerator.backward(model(**batch).loss)``
takes each microbatch's own label mean, and ``accelerator.backward`` divides it by the
accumulation steps A; DDP then averages over the W ranks: a label token of microbatch (r, m)
weighs 1/(W * A * N[r,m]), the `local` mode. The fix is gradnorm's drop-in in accelerate's terms:
take the step's A microbatches first, count their labels, all-reduce the count once, and give
each microbatch the loss sum(nll) * W * A / N, whose W undoes DDP's mean and whose A undoes
``accelerator.backward``'s division (gradnorm's ``rank_weights`` derives the W)::

    from gradnorm.integrations.accelerate_loop import step_label_count, token_sum_loss

    A = accelerator.gradient_accumulation_steps
    batches = [next(iterator) for _ in range(A)]
    num_tokens = step_label_count(accelerator, batches)        # THE one all-reduce of the step
    for m, batch in enumerate(batches):
        with accelerator.no_sync(model) if m < A - 1 else contextlib.nullcontext():  # the last one syncs
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            accelerator.backward(token_sum_loss(accelerator, logits, batch["labels"], num_tokens))
    optimizer.step()
    optimizer.zero_grad()

Not ``accelerator.accumulate``: it decides when to synchronize from the data loader's position, and
reading the step's microbatches ahead (which the count needs) makes it see the loader's end at the
first one, so it would step after one microbatch (measured: the trainer audit refuses that run as
stepping before the data set was read).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TESTED = {"accelerate": ("1.16.0",)}
"""Versions whose loop the trainer audit measured with these lines (tests/e2e/test_trainer_audit_trl.py)."""

IGNORE = -100


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    return labels[:, 1:]  # position t's logits predict labels[t + 1]


def step_label_count(accelerator, batches: list[dict]) -> int:
    """N: the label tokens of this rank's microbatches of the step, summed over every rank (one all-reduce)."""
    local = sum(int((_shifted(b["labels"]) != IGNORE).sum()) for b in batches)
    count = torch.tensor([local], device=accelerator.device, dtype=torch.long)
    return int(accelerator.reduce(count, reduction="sum").item())


def token_sum_loss(accelerator, logits: torch.Tensor, labels: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """sum of the microbatch's label cross-entropies * W * A / N: after accelerate's 1/A and DDP's 1/W, sum nll / N."""
    shift_logits, shift_labels = logits[:, :-1].float(), _shifted(labels).to(logits.device)
    nll = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
                          ignore_index=IGNORE, reduction="sum")
    scale = accelerator.num_processes * accelerator.gradient_accumulation_steps  # x W: DDP's mean; x A: backward's 1/A
    return nll * scale / max(num_tokens, 1)
