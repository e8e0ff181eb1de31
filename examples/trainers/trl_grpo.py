"""TRL's GRPOTrainer as build functions for the trainer audit (TRL 1.16); the probe's reward comes in as reward_func.

    python -m gradnorm.audit --trainer examples/trainers/trl_grpo.py:build_dapo --objective grpo
    python -m gradnorm.audit --trainer examples/trainers/trl_grpo.py:build_grpo --objective grpo
    python -m gradnorm.audit --trainer examples/trainers/trl_grpo.py:build_dapo_two_steps --objective grpo
    python -m gradnorm.audit --trainer examples/trainers/trl_grpo.py:build_dapo_two_steps_fixed --objective grpo

``per_device_batch`` counts completions; two completions a prompt (``num_generations``), 16 new
tokens at most. ``build_dapo`` is TRL's default loss (the token count of the generation batch,
rescaled to one accumulation window); ``build_grpo`` its per-sequence mean per microbatch;
``build_dr_grpo`` Dr GRPO's constant (a microbatch's sequences times max_completion_length);
``build_dapo_two_steps`` samples for two optimizer steps at once (steps_per_generation = 2 * A), so
the count spans both; ``build_dapo_two_steps_fixed`` is that one with gradnorm's fix
(``gradnorm.integrations.trl_grpo.GlobalTokenGRPOTrainer``).

TRL's configs default to bf16=True, which on a CPU autocasts the LM head to bfloat16: the audit
then reads every weight to bfloat16's rounding (and says so). These builds set bf16=False to read
the normalization itself, exactly.
"""

from trl import GRPOConfig, GRPOTrainer


def _trainer(model, tokenizer, train_dataset, reward_func, num_generations, output_dir, accum_steps, per_device_batch,
             trainer=GRPOTrainer, **changes):
    args = GRPOConfig(output_dir, per_device_train_batch_size=per_device_batch, gradient_accumulation_steps=accum_steps,
                      num_generations=num_generations, max_completion_length=16, max_steps=1, learning_rate=1e-3,
                      report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, seed=0, bf16=False, beta=0.0,
                      **changes)
    return trainer(model=model, reward_funcs=reward_func, args=args, train_dataset=train_dataset,
                   processing_class=tokenizer)


def build_dapo(model, tokenizer, train_dataset, reward_func, num_generations, *, output_dir, accum_steps,
               per_device_batch):
    return _trainer(model, tokenizer, train_dataset, reward_func, num_generations, output_dir, accum_steps,
                    per_device_batch, loss_type="dapo")


def build_grpo(model, tokenizer, train_dataset, reward_func, num_generations, *, output_dir, accum_steps,
               per_device_batch):
    return _trainer(model, tokenizer, train_dataset, reward_func, num_generations, output_dir, accum_steps,
                    per_device_batch, loss_type="grpo")


def build_dr_grpo(model, tokenizer, train_dataset, reward_func, num_generations, *, output_dir, accum_steps,
                  per_device_batch):
    return _trainer(model, tokenizer, train_dataset, reward_func, num_generations, output_dir, accum_steps,
                    per_device_batch, loss_type="dr_grpo")


def build_dapo_two_steps(model, tokenizer, train_dataset, reward_func, num_generations, *, output_dir, accum_steps,
                         per_device_batch):
    return _trainer(model, tokenizer, train_dataset, reward_func, num_generations, output_dir, accum_steps,
                    per_device_batch, loss_type="dapo", steps_per_generation=2 * accum_steps)


def build_dapo_two_steps_fixed(model, tokenizer, train_dataset, reward_func, num_generations, *, output_dir,
                               accum_steps, per_device_batch):
    from gradnorm.integrations.trl_grpo import GlobalTokenGRPOTrainer

    return _trainer(model, tokenizer, train_dataset, reward_func, num_generations, output_dir, accum_steps,
                    per_device_batch, trainer=GlobalTokenGRPOTrainer, loss_type="dapo",
                    steps_per_generation=2 * accum_steps)
