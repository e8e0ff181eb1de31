"""Prompts from a JSONL file and pluggable rewards: the task interface for real models.

A prompts file holds one JSON object per line with two fields:

    {"prompt": "What is 12 + 30?", "answer": "42"}

``PromptTask`` turns such a file into the same interface the trainer uses for the built-in
``RepeatTask`` (``sample_prompts``, ``reward``, ``tokenizer.eos_id`` / ``pad_id``, ``prompt_len``,
``max_new_tokens``), so rollouts, sharding and the normalization never know which task runs.

Prompt lengths differ, and a batched forward pass needs one width, so every prompt is LEFT-padded
to P = the longest prompt of the file (chat template included). The padding is a prefix of PAD ids
that the model's attention mask hides (``gradnorm.hfmodels``); left padding keeps every response
starting at column P, which is what the response mask and the log-prob slicing assume. Because P
is a property of the file, a sequence's tokens never depend on which other prompts share its step
or microbatch.

Rewards are functions ``reward(response_text, answer) -> float`` in a registry; ``--reward`` names
one, or points at any importable function as ``package.module:function``. A user's function that
fails to import, takes other arguments, raises, or returns something other than one finite number
is a ``RewardError``: one line naming the function and the sequence, then the user's own frames
(the trainer's are left out, they only say who called it).
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import numbers
import re
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

import torch

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
        examples.append(PromptExample(row["prompt"], answer if isinstance(answer, str) else json.dumps(answer)))
    if not examples:
        raise ValueError(f"prompts file {path} holds no prompts")
    return examples


# ---------------------------------------------------------------------------------------------
# Rewards: reward(response_text, answer) -> float, in a registry
# ---------------------------------------------------------------------------------------------

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available as ``--reward name``."""

    def add(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return add


class RewardError(ValueError):
    """A user's reward function failed: a one-line summary, then the user's frames."""

    def __init__(self, summary: str, cause: BaseException | None = None):
        super().__init__(summary)
        self.summary, self.frames = summary, _user_frames(cause) if cause is not None else ""

    def __str__(self) -> str:
        return self.summary + ("\n" + self.frames if self.frames else "")


# Frames of gradnorm and of the import machinery only say who called the user's code.
_PLUMBING = (str(Path(__file__).resolve().parent), str(Path(importlib.__file__).parent), "<frozen")


def _user_frames(err: BaseException) -> str:
    """The frames of ``err`` outside gradnorm and importlib, formatted like a traceback's."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(_PLUMBING)]
    lines = traceback.format_list(frames)
    if isinstance(err, SyntaxError):  # where the parser stopped: file, line and caret
        lines += traceback.format_exception_only(type(err), err)[:-1]
    return "".join(lines).rstrip("\n")


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}({str(err)!r})"


def get_reward(name: str) -> RewardFn:
    """A registered reward by name, or any function given as ``package.module:function``.

    Raises a RewardError when the function cannot be imported or does not take (response, answer).
    """
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise ValueError(f"unknown reward {name!r}: expected one of {', '.join(sorted(REWARDS))} or package.module:function")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name + ".").startswith(err.name + "."):  # the module itself, not one it imports
            raise RewardError(f"--reward {name!r}: cannot import it (no module named {err.name!r} on sys.path or "
                              "PYTHONPATH)") from None
        raise RewardError(f"reward function {name} failed to import: {_describe(err)}", err) from None
    except Exception as err:  # a syntax error or an exception at import time, in the user's module
        raise RewardError(f"reward function {name} failed to import: {_describe(err)}", err) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"--reward {name!r}: cannot import it (module {module_name} has no {attr!r})")
    if not callable(fn):
        raise RewardError(f"--reward {name!r} is not callable (it is a {type(fn).__name__})")
    try:
        inspect.signature(fn).bind("response", "answer")
    except TypeError:
        raise RewardError(f"reward function {name} must take (response, answer); its signature is "
                          f"{inspect.signature(fn)}") from None
    except ValueError:  # a builtin without a signature: it is called as it is
        pass
    return fn


def reward_name(fn: RewardFn) -> str:
    """``module:function`` of a reward, as --reward names it."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def call_reward(fn: RewardFn, response: str, answer: str, index: int) -> float:
    """``fn(response, answer)`` as a finite float; a RewardError naming the sequence otherwise."""
    try:
        value = fn(response, answer)
    except Exception as err:
        raise RewardError(f"reward function {reward_name(fn)} raised {_describe(err)} on sequence {index} "
                          f"(answer {answer!r})", err) from None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise RewardError(f"reward function {reward_name(fn)} returned {type(value).__name__} {value!r:.60} on "
                          f"sequence {index}; it must return one number (a float)")
    if not math.isfinite(value):
        raise RewardError(f"reward function {reward_name(fn)} returned {value} on sequence {index}; rewards must be "
                          "finite numbers")
    return float(value)


# A number as people write them: -12, 1,234 (thousands separators), 3.5, 3/4.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")


def _last_boxed(text: str) -> str | None:
    r"""The content of the last \boxed{...} in ``text``, braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the response was cut off inside the box


def extract_answer(text: str) -> str | None:
    r"""The final answer of a response: the last \boxed{} value if any, else its last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> Fraction | None:
    # Exact rational arithmetic, no float tolerance: "3.0" == "3" and "0.5" == "1/2", "0.30000001" != "0.3".
    try:
        return Fraction(text.strip().strip("$").replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


@register_reward("exact_match_math")
def exact_match_math(response: str, answer: str) -> float:
    r"""1.0 if the response's final answer equals ``answer`` exactly, else 0.0.

    The final answer is the last \boxed{...} value, or else the last number of the response.
    Two numbers compare as exact rationals (3 == 3.0 == 6/2, 1,234 == 1234); anything else
    compares as stripped text.
    """
    got = extract_answer(response)
    if got is None:
        return 0.0
    a, b = _as_number(got), _as_number(answer)
    if a is not None and b is not None:
        return float(a == b)
    return float(got.strip() == answer.strip())


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
    """A Hugging Face tokenizer (pad and eos ids set, see ``gradnorm.hfmodels.load_tokenizer``)."""
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
