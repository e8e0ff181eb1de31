"""Hand-written loops as build functions for the trainer audit: accelerate's finetune pattern, and gradnorm's fixes.

    python -m gradnorm.audit --trainer examples/trainers/loops.py:accelerate_model_loss   # SKEWED: local
    python -m gradnorm.audit --trainer examples/trainers/loops.py:accelerate_fixed        # INVARIANT: token
    python -m gradnorm.audit --trainer examples/trainers/loops.py:drop_in_sft             # INVARIANT: token

A build returns an object whose ``train()`` runs one epoch over the probe's texts:
``accelerate_model_loss`` is the model's own loss under ``accelerator.accumulate`` (a microbatch's
label mean, divided by A by ``accelerator.backward``); ``accelerate_fixed`` the same loop with
``gradnorm.integrations.accelerate_loop``; ``drop_in_sft`` a plain DDP loop around
``examples/drop_in_sft.py``'s ``accumulate``, unchanged.
"""

import contextlib
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorForLanguageModeling

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: drop_in_sft and its toy policy


def _loader(tokenizer, train_dataset, per_device_batch, **kwargs):
    tokenized = train_dataset.map(lambda r: tokenizer(r["text"]), remove_columns=["text"])
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # labels = input ids, padding -100
    return DataLoader(tokenized, batch_size=per_device_batch, collate_fn=collator, **kwargs)


class _Accelerate:
    def __init__(self, model, tokenizer, train_dataset, accum_steps, per_device_batch, fixed):
        from accelerate import Accelerator

        self.accelerator = Accelerator(gradient_accumulation_steps=accum_steps, cpu=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.model, self.optimizer, self.loader = self.accelerator.prepare(
            model, optimizer, _loader(tokenizer, train_dataset, per_device_batch))
        self.fixed = fixed

    def train(self):
        acc, model, optimizer = self.accelerator, self.model, self.optimizer
        if not self.fixed:  # the finetune pattern: the model's own loss
            for batch in self.loader:
                with acc.accumulate(model):
                    acc.backward(model(**batch).loss)
                    optimizer.step()
                    optimizer.zero_grad()
            return
        from gradnorm.integrations.accelerate_loop import step_label_count, token_sum_loss

        A, iterator = acc.gradient_accumulation_steps, iter(self.loader)
        for _ in range(len(self.loader) // A):
            batches = [next(iterator) for _ in range(A)]
            num_tokens = step_label_count(acc, batches)  # THE one all-reduce of the step
            for m, batch in enumerate(batches):
                with acc.no_sync(model) if m < A - 1 else contextlib.nullcontext():  # the last one syncs
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    acc.backward(token_sum_loss(acc, logits, batch["labels"], num_tokens))
            optimizer.step()
            optimizer.zero_grad()


def accelerate_model_loss(model, tokenizer, train_dataset, *, accum_steps, per_device_batch):
    return _Accelerate(model, tokenizer, train_dataset, accum_steps, per_device_batch, fixed=False)


def accelerate_fixed(model, tokenizer, train_dataset, *, accum_steps, per_device_batch):
    return _Accelerate(model, tokenizer, train_dataset, accum_steps, per_device_batch, fixed=True)


class _DropIn:
    """examples/drop_in_sft.py's accumulate in a DDP loop over the probe's texts (gloo; one process: a group of 1)."""

    def __init__(self, model, tokenizer, train_dataset, accum_steps, per_device_batch):
        import torch.distributed as dist

        if not dist.is_initialized():
            if "RANK" in os.environ:
                dist.init_process_group("gloo")
            else:
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model, self.accum_steps = model, accum_steps
        sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, shuffle=False)
        self.loader = _loader(tokenizer, train_dataset, per_device_batch, sampler=sampler)

    def train(self):
        from drop_in_sft import accumulate

        ddp = torch.nn.parallel.DistributedDataParallel(self.model)

        def ddp_logits(inputs):  # the drop-in calls model(inputs) for logits, and model.no_sync()
            return ddp(input_ids=inputs).logits

        ddp_logits.no_sync = ddp.no_sync
        optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        batches = list(self.loader)
        for start in range(0, len(batches), self.accum_steps):
            microbatches = [{"inputs": b["input_ids"], "labels": torch.cat(
                [b["labels"][:, 1:], torch.full_like(b["labels"][:, :1], -100)], dim=1)}  # labels[t]: the token after t
                for b in batches[start:start + self.accum_steps]]
            accumulate(ddp_logits, microbatches)
            optimizer.step()
            optimizer.zero_grad()


def drop_in_sft(model, tokenizer, train_dataset, *, accum_steps, per_device_batch):
    return _DropIn(model, tokenizer, train_dataset, accum_steps, per_device_batch)
