"""The notebooks' mode names (``gradnorm.modes``): the core's modes plus Dr GRPO's "constant"."""

import pytest

from gradnorm import modes
from gradnorm.denominators import MODES


def test_mode_names_are_the_core_modes_and_the_constant():
    assert modes.MODE_NAMES == (*MODES, "constant")
    assert modes.INVARIANT_MODES == ("token", "sequence", "group", "constant")
    assert set(modes.PAPER_OF_MODE) == set(modes.MODE_NAMES)


def test_resolve_and_dr_grpo_constant():
    assert modes.resolve("constant", 16, 64) == 1024.0
    assert modes.resolve("token", 16, 64) == "token"
    with pytest.raises(ValueError):
        modes.resolve("mean", 16, 64)
