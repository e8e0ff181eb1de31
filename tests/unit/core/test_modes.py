"""The notebooks' mode names (``gradnorm.core.modes``): the core's modes plus Dr GRPO's "constant"."""

import pytest

from gradnorm.core import modes
from gradnorm.core.denominators import MODES


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
    from gradnorm.teach import plotting
    from gradnorm.core.sharding import SHARD_KINDS
    from gradnorm.core.pairs import PAIR_MODES
    from gradnorm.teach.sweeps import DPO_MODES

    assert set(modes.MODE_NAMES) | set(DPO_MODES) <= set(plotting.MODE_COLORS)
    assert set(DPO_MODES) == set(PAIR_MODES)
    assert set(plotting.SHARD_STYLES) == set(SHARD_KINDS)


def test_one_palette_whose_families_never_share_a_colour():
    # A colour means one thing in every notebook: a mode, a rank, or a share of the tokens.
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    from gradnorm.audit import plot as auditplot
    from gradnorm.teach import lengthplots, palette, plotting, views
    from gradnorm.core.sharding import SHARD_KINDS

    modes = {to_hex(palette.MODE_COLORS[m]) for m in modes_of_the_palette()}
    ranks = {to_hex(c) for c in palette.RANK_COLORS}
    assert len(modes) == len(modes_of_the_palette()) and len(ranks) == len(palette.RANK_COLORS)
    assert not modes & ranks and to_hex(palette.TOKENS_COLOR) not in modes | ranks
    assert all("color" not in style for style in palette.SHARD_STYLES.values())  # shardings are line styles
    assert set(palette.SHARD_STYLES) == set(SHARD_KINDS) and set(palette.MODE_MARKERS) >= set(modes_of_the_palette())
    # ... and every drawing module takes it from there rather than keeping its own
    for module in (plotting, lengthplots, auditplot, views):
        assert module.MODE_COLORS is palette.MODE_COLORS if hasattr(module, "MODE_COLORS") else True
        assert not hasattr(module, "UPDATE_COLOR")


def modes_of_the_palette():
    return modes.MODE_NAMES  # "pair" (DPO) is token's rule and shares its colour on purpose
