"""TRL's DPOTrainer as a build function for the trainer audit (TRL 1.16).

    python -m gradnorm.audit --trainer examples/trainers/trl_dpo.py:build --objective dpo

The probe's records are preference pairs ({"prompt", "chosen", "rejected"}) of ragged lengths; the
reference model is a copy of the probe, so at the first step policy = reference and every margin
is 0 (the point where the audit reads a pair's weight, with beta = 0.1 as the audit's default).

TRL's configs default to bf16=True, which on a CPU autocasts the LM head to bfloat16: the audit
then reads every weight to bfloat16's rounding (and says so). These builds set bf16=False to read
the normalization itself, exactly.
"""

from trl import DPOConfig, DPOTrainer


def build(model, tokenizer, train_dataset, *, output_dir, accum_steps, per_device_batch):
    args = DPOConfig(output_dir, per_device_train_batch_size=per_device_batch, gradient_accumulation_steps=accum_steps,
                     num_train_epochs=1, learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                     use_cpu=True, seed=0, bf16=False, beta=0.1, max_length=None)
    return DPOTrainer(model=model, args=args, train_dataset=train_dataset, processing_class=tokenizer)
