"""What the policy is asked and how its answers are scored.

- ``repeat``   the built-in task ("repeat a letter n times") and its character tokenizer
- ``prompts``  a JSONL prompt file for Hugging Face models, tokenized with the model's template
- ``rewards``  reward functions: exact-match math, or any importable ``module:function``
"""

from gradnorm.tasks.repeat import CharTokenizer, RepeatTask

__all__ = ["CharTokenizer", "RepeatTask"]
