"""The mode names the notebooks and figures use: the core's modes plus Dr GRPO's "constant".

``gradnorm.core.denominators.MODES`` is the one table of modes; a constant denominator is a number
there. The notebooks also want Dr GRPO's constant C = S * max_new_tokens as a mode with a name,
"constant", which ``resolve`` turns into that number once S and max_new_tokens are known:

    "local", "token", "sequence", "group"   the modes of ``gradnorm.core.denominators``
    "constant"                              Dr GRPO's C = S * max_new_tokens (``dr_grpo_constant``)
"""

from __future__ import annotations

from gradnorm.core.denominators import MODES, Denominator

CONSTANT = "constant"
MODE_NAMES: tuple[str, ...] = (*MODES, CONSTANT)
INVARIANT_MODES: tuple[str, ...] = tuple(m for m in MODE_NAMES if m != "local")  # every mode but the bug
# Who uses which denominator (papers by name; see docs/design.md, "What the field got wrong").
PAPER_OF_MODE = {
    "sequence": "DeepSeekMath GRPO",
    "token": "DAPO",
    "constant": "Dr GRPO",
    "group": "per-prompt mean",
    "local": "per-microbatch mean (the bug)",
}


def dr_grpo_constant(num_sequences: int, max_new_tokens: int) -> float:
    """Dr GRPO's constant denominator C = S * max_new_tokens: the most tokens S responses can hold."""
    return float(num_sequences * max_new_tokens)


def resolve(mode: str, num_sequences: int, max_new_tokens: int) -> Denominator:
    """A name of ``MODE_NAMES`` -> the denominator ``gradnorm.core.denominators`` takes."""
    if mode == CONSTANT:
        return dr_grpo_constant(num_sequences, max_new_tokens)
    if mode not in MODE_NAMES:
        raise ValueError(f"unknown mode {mode!r}: expected one of {', '.join(MODE_NAMES)}")
    return mode
