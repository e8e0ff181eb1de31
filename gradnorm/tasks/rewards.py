"""Pluggable rewards for real-model tasks: ``reward(response_text, answer) -> float`` in a registry.

``--reward`` names a registered function (``exact_match_math``, the default) or points at any
importable function as ``package.module:function`` (loaded by ``gradnorm.cli.usercode``). A user's
function that fails to import, takes other arguments, raises, or returns something other than one
finite number is a ``RewardError``: one line naming the function and the sequence, then the user's
own frames (the trainer's are left out, they only say who called it).
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable
from fractions import Fraction

import torch

from gradnorm.cli.usercode import USER_EXITS, UserCodeError, describe, load_function, no_process_exit, user_frames

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
        self.summary, self.frames = summary, user_frames(cause) if cause is not None else ""

    def __str__(self) -> str:
        return self.summary + ("\n" + self.frames if self.frames else "")


def _cannot_load(name: str, err: UserCodeError) -> RewardError:
    """What ``--reward NAME`` says when ``load_function`` could not give it a function."""
    if err.kind == "import":  # a syntax error, an exception or sys.exit() at import time, in the user's module
        return RewardError(f"reward function {name} failed to import: {describe(err.cause, quoted=True)}", err.cause)
    if err.kind == "no module":
        return RewardError(f"--reward {name!r}: cannot import it (no module named {err.cause.name!r} on sys.path or "
                           "PYTHONPATH)")
    if err.kind == "no function":
        return RewardError(f"--reward {name!r}: cannot import it (module {err.where} has no {err.name!r})")
    if err.kind == "not callable":
        return RewardError(f"--reward {name!r} is not callable (it is a {type(err.found).__name__})")
    return RewardError(f"--reward {name!r}: {err}")


def get_reward(name: str) -> RewardFn:
    """A registered reward by name, or any function given as ``package.module:function``.

    Raises a RewardError when the function cannot be imported or does not take (response, answer).
    """
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise ValueError(f"unknown reward {name!r}: expected one of {', '.join(sorted(REWARDS))} or package.module:function")
    try:
        with no_process_exit():
            fn = load_function(name, files=False)
    except UserCodeError as err:
        raise _cannot_load(name, err) from None
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


FLOAT32_MAX = torch.finfo(torch.float32).max
"""The largest reward the trainer can keep: rewards become a float32 tensor in the rollout."""


def call_reward(fn: RewardFn, response: str, answer: str, index: int) -> float:
    """``fn(response, answer)`` as a float32-finite float; a RewardError naming the sequence otherwise.

    ``os._exit`` in ``fn`` is an error too (``no_process_exit``), and so is closing sys.stdout, which
    the trainer's next line of progress would trip over far from the cause.
    """
    try:
        with no_process_exit():
            value = fn(response, answer)
    except USER_EXITS as err:
        raise RewardError(f"reward function {reward_name(fn)} raised {describe(err, quoted=True)} on sequence {index} "
                          f"(answer {answer!r})", err) from None
    if sys.stdout is not None and sys.stdout.closed:
        raise RewardError(f"reward function {reward_name(fn)} closed sys.stdout on sequence {index}; a reward must "
                          "leave the trainer's output streams open (print, or log to a file of its own)")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise RewardError(f"reward function {reward_name(fn)} returned {type(value).__name__} {value!r:.60} on "
                          f"sequence {index}; it must return one number (a float)")
    if not math.isfinite(value):
        raise RewardError(f"reward function {reward_name(fn)} returned {value} on sequence {index}; rewards must be "
                          "finite numbers")
    if abs(value) > FLOAT32_MAX:  # finite here, inf once the rewards become the float32 tensor of the rollout
        raise RewardError(f"reward function {reward_name(fn)} returned {float(value):.4g} on sequence {index}, beyond "
                          f"float32's range (|reward| <= {FLOAT32_MAX:.4g}), in which the trainer keeps rewards")
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
