"""What the policy is asked and how its answers are scored.

- ``repeat``   the built-in tasks ("repeat a letter n times", and its bimodal variant) and their character tokenizer
- ``prompts``  a JSONL prompt file for Hugging Face models, tokenized with the model's template
- ``rewards``  reward functions: exact-match math, or any importable ``module:function``

``Task`` is what the trainer needs of either one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from gradnorm.tasks.repeat import BUILTIN_TASKS, CharTokenizer, RepeatTask, builtin_task


class TokenIdsLike(Protocol):
    pad_id: int
    eos_id: int


class Task(Protocol):
    """Prompts and a reward, seen by the trainer (``RepeatTask``, ``prompts.PromptTask``)."""

    tokenizer: TokenIdsLike
    """Its ``pad_id`` and ``eos_id``: a response ends at its first EOS, PAD fills the rest."""
    prompt_len: int
    """P: every prompt's length in tokens (left-padded to the longest)."""
    max_new_tokens: int
    """R: the longest response."""

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> tuple[Tensor, Sequence]:
        """(prompts (num_prompts, P) long, their answers), drawn from ``generator``."""
        ...

    def reward(self, responses: Tensor, answers: Sequence) -> Tensor:
        """(S,) float rewards of the responses (S, R) against their prompts' answers."""
        ...


__all__ = ["BUILTIN_TASKS", "CharTokenizer", "RepeatTask", "Task", "builtin_task"]
