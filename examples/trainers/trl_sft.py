"""TRL's SFTTrainer as build functions for the trainer audit (TRL 1.16).

    python -m gradnorm.audit --trainer examples/trainers/trl_sft.py:build               # padded batches
    python -m gradnorm.audit --trainer examples/trainers/trl_sft.py:build_padding_free  # packed rows

The probe's records are language-modeling texts ({"text": ...}); SFTTrainer tokenizes them, appends
EOS and trains on every token.

TRL's configs default to bf16=True, which on a CPU autocasts the LM head to bfloat16: the audit
then reads every weight to bfloat16's rounding (and says so). These builds set bf16=False to read
the normalization itself, exactly.
"""

from trl import SFTConfig, SFTTrainer


def _config(output_dir, accum_steps, per_device_batch, **changes):
    return SFTConfig(output_dir, per_device_train_batch_size=per_device_batch, gradient_accumulation_steps=accum_steps,
                     num_train_epochs=1, learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                     use_cpu=True, seed=0, bf16=False, max_length=None, **changes)


def build(model, tokenizer, train_dataset, *, output_dir, accum_steps, per_device_batch):
    return SFTTrainer(model=model, args=_config(output_dir, accum_steps, per_device_batch),
                      train_dataset=train_dataset, processing_class=tokenizer)


def build_padding_free(model, tokenizer, train_dataset, *, output_dir, accum_steps, per_device_batch):
    args = _config(output_dir, accum_steps, per_device_batch, padding_free=True)
    return SFTTrainer(model=model, args=args, train_dataset=train_dataset, processing_class=tokenizer)
