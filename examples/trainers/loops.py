"""Hand-written loops as build functions for the trainer audit: accelerate's finetune pattern, and gradnorm's fixes.

    python -m gradnorm.audit --trainer examples/trainers/loops.py:accelerate_model_loss   # SKEWED: local
    python -m gradnorm.audit --trainer examples/trainers/loops.py:accelerate_fixed        # INVARIANT: token
    python -m gradnorm.audit --trainer examples/trainers/loops.py:drop_in_sft             # INVARIANT: token
    python -m gradnorm.audit --trainer examples/trainers/loops.py:drop_in_dpo --objective dpo  # INVARIANT: pair

A build returns an object whose ``train()`` runs one epoch over the probe's texts:
``accelerate_model_loss`` is the model's own loss under ``accelerator.accumulate`` (a microbatch's
label mean, divided by A by ``accelerator.backward``); ``accelerate_fixed`` the same loop with
``gradnorm.integrations.accelerate_loop``; ``drop_in_sft`` and ``drop_in_dpo`` plain DDP loops
around ``examples/drop_in_sft.py``'s and ``examples/drop_in_dpo.py``'s ``accumulate``, unchanged.
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


def process_group():
    """gloo under torchrun; one process: a group of one, so the drop-in's all-reduce runs as written (the
    drop-in loops here and in drop_in_grpo.py)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class _DropIn:
    """examples/drop_in_sft.py's accumulate in a DDP loop over the probe's texts."""

    def __init__(self, model, tokenizer, train_dataset, accum_steps, per_device_batch):
        process_group()
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


class _DropInDPO:
    """examples/drop_in_dpo.py's accumulate in a DDP loop over the probe's pairs, against a frozen copy as reference."""

    def __init__(self, model, tokenizer, train_dataset, accum_steps, per_device_batch):
        import copy

        process_group()
        self.model, self.ref = model, copy.deepcopy(model).eval()
        self.accum_steps, self.tokenizer = accum_steps, tokenizer
        sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, shuffle=False)
        self.loader = DataLoader(train_dataset, batch_size=per_device_batch, sampler=sampler, collate_fn=self._pairs)

    def _pairs(self, records):
        """The drop-in's microbatch: prompt + response ids per side, padded, masks over the response's labels."""
        def ids(text):
            return self.tokenizer(text)["input_ids"]

        sides = {side: [ids(r["prompt"]) + ids(r[side]) for r in records] for side in ("chosen", "rejected")}
        width = max(len(t) for rows in sides.values() for t in rows)
        batch = {}
        for side, rows in sides.items():
            tokens = torch.full((len(rows), width), self.tokenizer.pad_token_id)
            mask = torch.zeros(len(rows), width - 1, dtype=torch.bool)  # label t is token t + 1
            for i, (r, row) in enumerate(zip(records, rows)):
                tokens[i, : len(row)] = torch.tensor(row)
                mask[i, len(ids(r["prompt"])) - 1: len(row) - 1] = True
            batch[side], batch[f"{side}_mask"] = tokens, mask
        return batch

    def train(self):
        from drop_in_dpo import accumulate

        ddp = torch.nn.parallel.DistributedDataParallel(self.model)

        def ddp_logits(inputs):  # the drop-in calls model(tokens) for logits, and model.no_sync()
            return ddp(input_ids=inputs).logits

        def ref_logits(inputs):
            return self.ref(input_ids=inputs).logits

        ddp_logits.no_sync = ddp.no_sync
        optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        batches = list(self.loader)
        for start in range(0, len(batches), self.accum_steps):
            accumulate(ddp_logits, ref_logits, batches[start:start + self.accum_steps])
            optimizer.step()
            optimizer.zero_grad()


def drop_in_dpo(model, tokenizer, train_dataset, *, accum_steps, per_device_batch):
    return _DropInDPO(model, tokenizer, train_dataset, accum_steps, per_device_batch)
