"""Pluggable rewards for real-model tasks: ``reward(response_text, answer) -> float`` in a registry.

``--reward`` names a registered function (``exact_match_math``, the default) or points at any
importable function as ``package.module:function``. A user's function that fails to import, takes
other arguments, raises, or returns something other than one finite number is a ``RewardError``:
one line naming the function and the sequence, then the user's own frames (the trainer's are left
out, they only say who called it).
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
import traceback
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import torch

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
_PLUMBING = (str(Path(__file__).resolve().parents[1]), str(Path(importlib.__file__).parent), "<frozen")


def _user_frames(err: BaseException) -> str:
    """The frames of ``err`` outside gradnorm and importlib, formatted like a traceback's."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(_PLUMBING)]
    lines = traceback.format_list(frames)
    if isinstance(err, SyntaxError):  # where the parser stopped: file, line and caret
        lines += traceback.format_exception_only(type(err), err)[:-1]
    return "".join(lines).rstrip("\n")


def _describe(err: BaseException) -> str:
    if isinstance(err, SystemExit):  # sys.exit(code) in user code: name the code, never pass it on
        return f"SystemExit({err.code!r})"
    return f"{type(err).__name__}({str(err)!r})"


USER_EXITS = (Exception, SystemExit, KeyboardInterrupt)
"""What user code may raise that is its failure: sys.exit(0) or a KeyboardInterrupt it raises itself
must not end the trainer with exit 0 or a traceback (a real Ctrl-C never raises in the trainer:
``guards.catch_signals`` turns it into a stop request)."""


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
    except USER_EXITS as err:  # a syntax error, an exception or sys.exit() at import time, in the user's module
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
    except USER_EXITS as err:
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
