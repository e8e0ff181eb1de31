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


def test_every_table_keyed_by_mode_or_sharding_covers_its_vocabulary():
    pytest.importorskip("matplotlib")
    from gradnorm import plotting
    from gradnorm.sharding import SHARD_KINDS
    from gradnorm.sweeps import DPO_MODES

    assert set(modes.MODE_NAMES) | set(DPO_MODES) <= set(plotting.MODE_COLORS)
    assert set(DPO_MODES.values()) <= set(MODES)
    assert set(plotting.SHARD_STYLES) == set(SHARD_KINDS)
