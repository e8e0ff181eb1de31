"""An ordinary transformers training script, audited unchanged with ``--script``:

    python -m gradnorm.audit --script -- torchrun --standalone --nproc_per_node 2 \\
        examples/trainers/hf_script.py --model {model} --data {data} --output-dir {output_dir} --grad-accum 2

It fine-tunes a causal LM on a JSONL file of {"text": ...} with the Trainer. ``--drop-loss-kwargs``
wraps the model's forward in one that takes **kwargs and drops num_items_in_batch (a custom
model's habit); the audit finds that one SKEWED, with every gradient W*A times too large.
"""

import argparse

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--data", required=True)
p.add_argument("--output-dir", required=True)
p.add_argument("--grad-accum", type=int, default=1)
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--drop-loss-kwargs", action="store_true")
args = p.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model)
if args.drop_loss_kwargs:
    forward = model.forward
    model.forward = lambda input_ids=None, attention_mask=None, labels=None, **kwargs: forward(
        input_ids=input_ids, attention_mask=attention_mask, labels=labels)
data = load_dataset("json", data_files=args.data, split="train").map(lambda r: tokenizer(r["text"]),
                                                                     remove_columns=["text"])
training = TrainingArguments(args.output_dir, per_device_train_batch_size=args.batch_size,
                             gradient_accumulation_steps=args.grad_accum, num_train_epochs=1, learning_rate=1e-3,
                             report_to=[], save_strategy="no", use_cpu=True)
Trainer(model=model, args=training, train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)).train()
