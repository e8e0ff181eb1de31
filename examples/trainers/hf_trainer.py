"""transformers' Trainer on a causal LM's own loss, as a build function for the trainer audit.

    python -m gradnorm.audit --trainer examples/trainers/hf_trainer.py:build            # INVARIANT, token
    python -m gradnorm.audit --trainer examples/trainers/hf_trainer.py:build_dropping   # SKEWED, x W*A
    python -m gradnorm.audit --trainer examples/trainers/hf_trainer.py:build_per_rank   # SKEWED
    python -m gradnorm.audit --trainer examples/trainers/hf_trainer.py:build_dropping_fixed   # INVARIANT

``build`` is the ordinary setup: the model computes its own loss and takes the loss kwargs, so
the Trainer hands it ``num_items_in_batch``, the label count of the whole optimizer step over every
rank. ``build_dropping`` wraps the model's forward in one that does not take them (as many custom
models do); ``build_per_rank`` turns ``average_tokens_across_devices`` off, so each rank counts its
own labels only. ``build_dropping_fixed`` is the dropping model with gradnorm's fix, the Trainer's
``compute_loss_func=global_token_loss`` (``gradnorm.integrations.hf_trainer``).
"""

from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments


def _args(output_dir, accum_steps, per_device_batch, **changes):
    return TrainingArguments(output_dir, per_device_train_batch_size=per_device_batch,
                             gradient_accumulation_steps=accum_steps, num_train_epochs=1, learning_rate=1e-3,
                             report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
                             dataloader_drop_last=False, seed=0, **changes)


def _trainer(model, tokenizer, train_dataset, args, **extra):
    tokenized = train_dataset.map(lambda r: tokenizer(r["text"]), remove_columns=["text"])
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # labels = input ids, padding -100
    return Trainer(model=model, args=args, train_dataset=tokenized, data_collator=collator, **extra)


def build(model, tokenizer, train_dataset, *, output_dir, accum_steps, per_device_batch):
    return _trainer(model, tokenizer, train_dataset, _args(output_dir, accum_steps, per_device_batch))


def _drop_loss_kwargs(model):
    """A forward that takes **kwargs (so the Trainer passes num_items_in_batch) and drops them, as many
    custom models do: the loss is the model's own mean over the microbatch's labels."""
    forward = model.forward

    def forward_dropping(input_ids=None, attention_mask=None, labels=None, **kwargs):
        return forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    model.forward = forward_dropping


def build_dropping(model, tokenizer, train_dataset, *, output_dir, accum_steps, per_device_batch):
    _drop_loss_kwargs(model)
    return _trainer(model, tokenizer, train_dataset, _args(output_dir, accum_steps, per_device_batch))


def build_per_rank(model, tokenizer, train_dataset, *, output_dir, accum_steps, per_device_batch):
    args = _args(output_dir, accum_steps, per_device_batch, average_tokens_across_devices=False)
    return _trainer(model, tokenizer, train_dataset, args)


def build_dropping_fixed(model, tokenizer, train_dataset, *, output_dir, accum_steps, per_device_batch):
    """The dropping model with gradnorm's fix: the Trainer's compute_loss_func, one line."""
    from gradnorm.integrations.hf_trainer import global_token_loss

    _drop_loss_kwargs(model)
    return _trainer(model, tokenizer, train_dataset, _args(output_dir, accum_steps, per_device_batch),
                    compute_loss_func=global_token_loss)
