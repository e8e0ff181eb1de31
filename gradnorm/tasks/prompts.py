"""Prompts from a JSONL file and pluggable rewards: the task interface for real models.

A prompts file holds one JSON object per line with two fields:

    {"prompt": "What is 12 + 30?", "answer": "42"}

``PromptTask`` turns such a file into the same interface the trainer uses for the built-in
``RepeatTask`` (``sample_prompts``, ``reward``, ``tokenizer.eos_id`` / ``pad_id``, ``prompt_len``,
``max_new_tokens``), so rollouts, sharding and the normalization never know which task runs.

Prompt lengths differ, and a batched forward pass needs one width, so every prompt is LEFT-padded
to P = the longest prompt of the file (chat template included). The padding is a prefix of PAD ids
that the model's attention mask hides (``gradnorm.models.hf``); left padding keeps every response
starting at column P, which is what the response mask and the log-prob slicing assume. Because P
is a property of the file, a sequence's tokens never depend on which other prompts share its step
or microbatch.

The reward of a response is a function ``reward(response_text, answer) -> float`` from
``gradnorm.tasks.rewards`` (``--reward``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from gradnorm.tasks.rewards import RewardFn, call_reward, exact_match_math, get_reward

# ---------------------------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptExample:
    prompt: str
    """What the user asks; the chat template (if any) wraps it."""
    answer: str
    """The reference the reward compares against (numbers are kept as their JSON text)."""


def load_prompts(path: str | Path) -> list[PromptExample]:
    """Read a JSONL prompts file; one-line errors name the file, the line and what is wrong.

    Blank lines are skipped. ``answer`` may be a JSON string or number (42 and "42" are the same).
    """
    path = Path(path)
    if path.is_dir() or (path.exists() and not path.is_file()):  # a directory, a FIFO, a device
        raise ValueError(f"prompts file {path} is {'a directory' if path.is_dir() else 'not a regular file'}: give a "
                         "JSONL file with \"prompt\" and \"answer\" on each line")
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist (expected JSONL lines with \"prompt\" and \"answer\")")
    examples = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
        except ValueError as e:  # a number of more than 4300 digits: Python's int conversion limit
            if "digits" not in str(e):
                raise
            raise ValueError(f"{path}:{n}: a number with more digits than Python converts (4300); write it as a "
                             "string (\"answer\": \"123...\")") from None
        except RecursionError:  # e.g. 100000 nested brackets: Python's parser gives up on the depth
            raise ValueError(f"{path}:{n}: nested too deeply to read (a line is one object with \"prompt\" and "
                             "\"answer\")") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object with \"prompt\" and \"answer\", got {type(row).__name__}")
        for key in ("prompt", "answer"):
            if key not in row:
                raise ValueError(f"{path}:{n}: missing field {key!r} (every line needs \"prompt\" and \"answer\")")
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError(f"{path}:{n}: \"prompt\" must be a non-empty string")
        answer = row["answer"]
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{path}:{n}: \"answer\" must be a string or a number, got {type(answer).__name__}")
        if isinstance(answer, float) and not math.isfinite(answer):  # NaN / Infinity: JSON's loader takes them
            raise ValueError(f"{path}:{n}: \"answer\" is {answer}, which no response can match; write the answer "
                             "as a finite number or a string")
        examples.append(PromptExample(row["prompt"], answer if isinstance(answer, str) else json.dumps(answer)))
    if not examples:
        raise ValueError(f"prompts file {path} holds no prompts")
    return examples


# ---------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------


@dataclass
class TokenIds:
    """The special ids the trainer needs, plus decode; wraps a Hugging Face tokenizer."""

    hf: Any = field(repr=False)
    """The Hugging Face tokenizer."""
    pad_id: int
    """PAD: left padding of prompts and filler after EOS (may equal eos_id)."""
    eos_id: int
    """EOS: a response ends at the first one."""

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of ``ids`` up to (not including) the first EOS, special tokens skipped."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.hf.decode(ids, skip_special_tokens=True)


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of one prompt: through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        # Render to text, then encode without adding specials: the template already writes the
        # BOS it wants, and tokenize=True returns a list in transformers 4 but a dict in 5.
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])  # the tokenizer's own BOS, if it adds one


@dataclass
class PromptTask:
    """Prompts from a JSONL file, a Hugging Face tokenizer and a reward function."""

    examples: list[PromptExample]
    """The file's prompts and answers."""
    tokenizer_hf: Any = field(repr=False)
    """A Hugging Face tokenizer (pad and eos ids set, see ``gradnorm.models.hf.load_tokenizer``)."""
    reward_fn: RewardFn = exact_match_math
    """reward(response_text, answer) -> float in [0, max_reward]."""
    max_new_tokens: int = 64
    """Response budget of the sampler."""

    tokenizer: TokenIds = field(init=False, repr=False)
    """Derived: pad_id, eos_id and decode for the trainer."""
    prompt_ids: torch.Tensor = field(init=False, repr=False)
    """Derived: (num_examples, P) long, every prompt left-padded with PAD to P."""
    max_reward: ClassVar[float] = 1.0

    def __post_init__(self):
        tok = self.tokenizer_hf
        if tok.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token: a response could never end")
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.tokenizer = TokenIds(tok, pad_id=int(pad), eos_id=int(tok.eos_token_id))
        encoded = [encode_prompt(tok, ex.prompt) for ex in self.examples]
        P = max(len(ids) for ids in encoded)
        self.prompt_ids = torch.full((len(encoded), P), self.tokenizer.pad_id, dtype=torch.long)
        for i, ids in enumerate(encoded):
            if ids and ids[0] == self.tokenizer.pad_id:
                # The attention mask treats a leading run of PAD as padding; such a prompt would lose it.
                raise ValueError(f"prompt {i} starts with the PAD token id {self.tokenizer.pad_id}; set a distinct pad token")
            self.prompt_ids[i, P - len(ids):] = torch.tensor(ids, dtype=torch.long)

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: Any, reward: str = "exact_match_math", max_new_tokens: int = 64) -> PromptTask:
        return cls(load_prompts(path), tokenizer, get_reward(reward), max_new_tokens)

    @property
    def prompt_len(self) -> int:
        """P: the longest prompt of the file; shorter ones are left-padded to it."""
        return self.prompt_ids.shape[1]

    @property
    def block_size(self) -> int:
        """Longest sequence the sampler produces: P + max_new_tokens."""
        return self.prompt_len + self.max_new_tokens

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> tuple[torch.Tensor, list[str]]:
        """Prompts (num_prompts, P) and their answers, a pure function of the generator state.

        Distinct prompts while the file has enough (a random permutation), else with replacement.
        """
        n = len(self.examples)
        if num_prompts <= n:
            idx = torch.randperm(n, generator=generator)[:num_prompts]
        else:
            idx = torch.randint(n, (num_prompts,), generator=generator)
        return self.prompt_ids[idx].clone(), [self.examples[i].answer for i in idx.tolist()]

    def reward(self, response_ids: torch.Tensor | Sequence[Sequence[int]], answers: Sequence[str]) -> torch.Tensor:
        """reward_fn(decoded response up to its first EOS, answer) for each response, (B,) float32."""
        if isinstance(response_ids, torch.Tensor):
            response_ids = response_ids.tolist()
        if len(response_ids) != len(answers):
            raise ValueError(f"{len(response_ids)} responses but {len(answers)} answers")
        return torch.tensor(
            [call_reward(self.reward_fn, self.tokenizer.decode(ids), a, i)
             for i, (ids, a) in enumerate(zip(response_ids, answers))],
            dtype=torch.float32,
        )
