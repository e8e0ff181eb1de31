"""The notebooks' explorers, driven without a browser.

Each test builds an explorer, moves a control the way a reader would (setting its ``value``), and
checks that the drawn data (bar bounds, line data) and the readout changed as the math says, by
recomputing the expected numbers with ``gradnorm.teach.imbalance`` and ``gradnorm.teach.runs``. Pixels are
compared in one place only: a frame the in-place canvas blits must equal the same figure drawn
from scratch (``test_blitted_frames_equal_full_redraws``), so caching never shows a stale picture.
"""

import numpy as np
import pytest
from numpy.testing import assert_allclose

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from gradnorm.teach import widgets  # noqa: E402
from gradnorm.teach.imbalance import batch_rank_shares, imbalanced_minibatch, token_layout  # noqa: E402
from gradnorm.teach.widgets import bar_heights  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def test_token_imbalance_explorer_defaults():
    explorer = widgets.token_imbalance_explorer()
    assert explorer.values == {"world_size": 2, "accum_steps": 2, "imbalance": 4}
    # 24-token responses, the short microbatch has 6-token ones: 12, 48 | 48, 48 tokens, N = 156
    assert_allclose(bar_heights(explorer.artists["share_bars"]["local"]), [0.5, 0.5])
    assert_allclose(bar_heights(explorer.artists["share_bars"]["tokens"]), [60 / 156, 96 / 156])
    assert_allclose(bar_heights(explorer.artists["share_bars"]["token"]), [60 / 156, 96 / 156])
    # heights are w x N; widths the response's share of the tokens; areas its share of the update
    bars = explorer.artists["weights"]["local"]
    assert_allclose(bar_heights(bars), [156 / 48] * 2 + [156 / 192] * 6)
    assert_allclose([b.get_width() for b in bars], [6 / 156] * 2 + [24 / 156] * 6)
    assert_allclose(sum(b.get_width() * b.get_height() for b in bars), 1.0)
    assert_allclose(explorer.artists["line"].get_ydata(), 1.0)  # token: every token weighs 1/N
    assert "rank 0 holds 38% of the tokens: 50% of the update under local, 38% of the update under token" in explorer.text
    # the ratio to a token of a full microbatch (the imbalance) and to the correct weight 1/N
    assert "weighs 4.00x a token of a full microbatch and 3.25x its correct weight 1/N" in explorer.text
    assert explorer.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert "application/vnd.jupyter.widget-view+json" in explorer._repr_mimebundle_()


def test_the_png_decodes_to_the_rendered_pixels():
    from io import BytesIO

    from PIL import Image

    explorer = widgets.token_imbalance_explorer()
    decoded = np.asarray(Image.open(BytesIO(explorer.image.value)).convert("RGBA"))
    np.testing.assert_array_equal(decoded, explorer.canvas.render())


@pytest.mark.parametrize("factory, moves", [
    ("token_imbalance_explorer", [{"imbalance": 24}, {"world_size": 5}, {"accum_steps": 1}, {"imbalance": 2},
                                  {"world_size": 2, "accum_steps": 2, "imbalance": 4}, {"imbalance": 6}]),
    ("length_bias_explorer", [{"wrong_len": 64}, {"correct_len": 1}, {"num_correct": 7}, {"scale_by_std": False},
                              {"wrong_len": 40, "correct_len": 10, "num_correct": 4}]),
])
def test_blitted_frames_equal_full_redraws(factory, moves):
    # The control is the same figure drawn from scratch; a stale background or axis cache would differ.
    explorer = getattr(widgets, factory)()
    for values in moves:
        explorer.update(**values)
        blitted = explorer.canvas.render().copy()
        explorer.canvas.blit = False
        full = explorer.canvas.render().copy()
        explorer.canvas.blit = True
        np.testing.assert_array_equal(blitted, full, err_msg=str(values))


def test_each_axis_state_is_drawn_once_then_pasted():
    explorer = widgets.token_imbalance_explorer()
    for value in (2, 8, 2, 8):  # warm: the ladder limits of imbalance 2 and 8 are in the cache
        explorer.update(imbalance=value)
    draws, redraws = explorer.canvas.axis_draws, explorer.canvas.full_redraws
    for value in (2, 8, 2, 8, 2):
        explorer.update(imbalance=value)
    assert (explorer.canvas.axis_draws, explorer.canvas.full_redraws) == (draws, redraws)
    explorer.update(world_size=5)  # five ranks: the share panel's axis takes a new state, drawn once
    assert explorer.canvas.axis_draws > draws and explorer.canvas.full_redraws == redraws


def test_the_weight_axis_stays_put_and_the_short_microbatch_is_named():
    # Frames compare only on one height axis; the note gives the thin bar's shares, read off the layout.
    explorer = widgets.token_imbalance_explorer()
    limits = set()
    for values in ({"imbalance": 1}, {"imbalance": 24}, {"world_size": 8, "accum_steps": 8}, {"imbalance": 4}):
        artists = explorer.update(**values)
        limits.add(explorer.figure.axes[0].get_ylim())
        lay, n = artists["layout"]["local"], artists["layout"]["local"].length.sum()
        tallest = float(lay.weight.max() * n)
        assert tallest <= explorer.figure.axes[0].get_ylim()[1]
        first = (lay.rank == 0) & (lay.microbatch == 0)
        assert f"{lay.length[first].sum() / n:.1%} of the tokens" in artists["note"].get_text()
        assert f"{(lay.weight[first] * lay.length[first]).sum():.1%} of the update" in artists["note"].get_text()
    assert len(limits) == 1  # an axis following the data would take three limits here (1.25, 25, 4)


def test_a_view_change_it_did_not_declare_dynamic_is_drawn_anyway():
    # The safety net: a static label changed behind the canvas's back forces a full redraw.
    explorer = widgets.token_imbalance_explorer()
    before = explorer.canvas.full_redraws
    explorer.update(imbalance=2)
    assert explorer.canvas.full_redraws == before  # blitted
    explorer.figure.axes[0].set_xlabel("something else")
    explorer.update(imbalance=3)
    assert explorer.canvas.full_redraws == before + 1


def test_moving_the_imbalance_slider_to_one_balances_local():
    explorer = widgets.token_imbalance_explorer()
    before = (explorer.image.value, explorer.readout.value)
    explorer.controls["imbalance"].value = 1  # what a reader's keyboard does
    assert_allclose(bar_heights(explorer.artists["share_bars"]["tokens"]), [0.5, 0.5])
    assert_allclose(bar_heights(explorer.artists["weights"]["local"]), 1.0)  # balanced: local is the token mean
    assert "rank 0 holds 50% of the tokens: 50% of the update" in explorer.readout.value
    assert "weighs 1.00x a token of a full microbatch and 1.00x its correct weight" in explorer.text
    assert explorer.image.value != before[0] and explorer.readout.value != before[1]


@pytest.mark.parametrize("world_size, accum_steps, imbalance", [(4, 1, 8), (3, 2, 12), (1, 1, 6), (8, 8, 24)])
def test_bar_heights_follow_the_sliders(world_size, accum_steps, imbalance):
    explorer = widgets.token_imbalance_explorer()
    artists = explorer.update(world_size=world_size, accum_steps=accum_steps, imbalance=imbalance)
    batch = imbalanced_minibatch(world_size, accum_steps, imbalance, full_length=widgets.FULL_LENGTH)
    for mode in ("local", "token"):
        shares = batch_rank_shares(batch, mode)
        assert_allclose(bar_heights(artists["share_bars"][mode]), shares.update)
    layout = token_layout(batch, "local")
    n = layout.length.sum()
    assert_allclose(bar_heights(artists["weights"]["local"]), layout.weight * n)
    assert_allclose([b.get_x() for b in artists["weights"]["local"]], layout.left / n)
    assert sum(b.get_visible() for b in explorer.artists["weights"]["local"]) == len(batch.lengths)
    assert len(artists["share_bars"]["local"]) == world_size
    local = batch_rank_shares(batch, "local")
    expected = f"rank 0 holds {local.tokens[0]:.0%} of the tokens: {local.update[0]:.0%} of the update"
    assert expected in explorer.readout.value
    if world_size * accum_steps > 1:  # the control: ragged microbatches must move local off the tokens
        assert not np.allclose(local.update, local.tokens)
    else:  # one microbatch: its local mean is the global mean
        assert_allclose(local.update, local.tokens)


SPREADS = [1, 4, 12]


@pytest.fixture(scope="module")
def gradient_explorer():
    return widgets.gradient_explorer(SPREADS)


def test_gradient_explorer_lines_are_the_sweep(gradient_explorer):
    from gradnorm.teach.views import COSINE_FLOOR, LOG_FLOOR

    explorer = gradient_explorer
    explorer.update(mode="local", shard="length", spread=12.0)
    error_line, cosine_line = explorer.artists["lines"]["local"]
    sweep = explorer.artists["sweep"]
    assert_allclose(error_line.get_xdata(), SPREADS)
    assert_allclose(error_line.get_ydata(), np.maximum(sweep.relative_error["local"], LOG_FLOOR))
    assert_allclose(cosine_line.get_ydata(), np.maximum(1 - sweep.cosine["local"], COSINE_FLOOR))
    assert error_line.get_ydata()[-1] > 0.3 and error_line.get_ydata()[0] < 1e-12
    assert_allclose(bar_heights(explorer.artists["tokens"]), sweep.microbatch_tokens[-1].reshape(-1))
    assert f"relative error {sweep.relative_error['local'][-1]:.3g}" in explorer.readout.value


def test_gradient_explorer_names_its_mode_above_the_curves(gradient_explorer):
    """The mode's label sits above the error axes, so no curve can run through it: under
    ``balanced`` local's error jumps between rounding and a few percent across the whole height."""
    explorer = gradient_explorer
    explorer.update(mode="local", shard="balanced", spread=12.0)
    ax = explorer.artists["lines"]["local"][0].axes
    label = next(t for t in ax.texts if t.get_text() == "mode: local")
    x, y = label.get_position()
    assert label.get_transform() == ax.transAxes and y > 1.0 and label.get_va() == "bottom"


def test_gradient_explorer_mode_shard_and_spread(gradient_explorer):
    explorer = gradient_explorer
    explorer.update(mode="local", shard="length", spread=12.0)
    length_tokens = bar_heights(explorer.artists["tokens"])
    explorer.controls["mode"].value = "token"
    error_line, cosine_line = explorer.artists["lines"]["token"]
    assert np.all(error_line.get_ydata() < 1e-12) and np.all(cosine_line.get_ydata() < 1e-12)
    explorer.controls["shard"].value = "balanced"
    balanced_tokens = bar_heights(explorer.artists["tokens"])
    assert balanced_tokens.max() - balanced_tokens.min() < length_tokens.max() - length_tokens.min()
    assert "balanced sharding" in explorer.readout.value
    explorer.controls["spread"].value = 1.0
    assert_allclose(bar_heights(explorer.artists["tokens"]), 8 * 12)  # every response has 12 tokens
    assert explorer.artists["index"] == 0


def test_length_bias_explorer():
    explorer = widgets.length_bias_explorer()
    view = explorer.artists["view"]
    modes = list(view.push_per_token)
    assert_allclose(bar_heights(explorer.artists["correct"]), [view.push_per_token[m][0] for m in modes])
    assert_allclose(bar_heights(explorer.artists["wrong"]), [view.push_per_token[m][1] for m in modes])
    up, down = view.push_per_token["sequence"]
    assert abs(down) / up == pytest.approx(10 / 40)
    assert "<b>0.25x</b>" in explorer.readout.value
    assert_allclose(bar_heights(explorer.artists["share_correct"]) + bar_heights(explorer.artists["share_wrong"]), 1)
    explorer.controls["wrong_len"].value = 10  # equal lengths: no length bias left
    view = explorer.artists["view"]
    up, down = view.push_per_token["sequence"]
    assert abs(down) / up == pytest.approx(1.0)
    assert_allclose(bar_heights(explorer.artists["share_correct"]), 0.5)
    assert "<b>1.00x</b>" in explorer.readout.value
    before = explorer.readout.value
    explorer.controls["scale_by_std"].value = False
    assert explorer.artists["view"].advantage_correct == pytest.approx(0.5)  # 1 - mean reward 0.5
    # the std moves only the advantages, and the readout says so in its first line
    assert "Advantages: +0.500 for a correct response, -0.500 for a wrong one." in explorer.readout.value
    assert explorer.readout.value != before and explorer.readout.value.split(" N = ")[1] == before.split(" N = ")[1]


def test_token_imbalance_stills_fit_their_own_height_axis():
    fixed, fitted = widgets.token_imbalance_explorer(), widgets.token_imbalance_explorer(fit_axis=True)
    tops = {}
    for k in (4, 24):
        for name, explorer in (("fixed", fixed), ("fitted", fitted)):
            explorer.update(imbalance=k)
            tops[name, k] = explorer.figure.axes[0].get_ylim()[1]
    tallest = max(bar_heights(fitted.artists["weights"]["local"]))
    assert tops["fixed", 4] == tops["fixed", 24] > 4 * 3.25  # the sliders' one axis flattens the default
    assert 156 / 48 <= tops["fitted", 4] < 2 * 156 / 48 < tops["fitted", 24] and tops["fitted", 24] >= tallest


def test_length_bias_stills_share_one_push_axis():
    from gradnorm.teach import lengthbias, views

    settings = [{"correct_len": 10, "wrong_len": 40, "num_correct": 4}, {"correct_len": 10, "wrong_len": 40, "num_correct": 1}]
    data = [lengthbias.correct_vs_wrong(**s) for s in settings]
    axis = views.push_axis(data, list(data[0].push_per_token))
    pushes = [p for d in data for p in d.push_per_token.values()]
    assert axis[0] <= min(w for _, w in pushes) and axis[1] >= max(c for c, _ in pushes)
    shared = widgets.length_bias_explorer(ylim=axis)
    fitted = widgets.length_bias_explorer()
    limits = {"shared": set(), "fitted": set()}
    for values in settings:
        for name, explorer in (("shared", shared), ("fitted", fitted)):
            explorer.update(**values)
            limits[name].add(explorer.figure.axes[0].get_ylim())
    assert limits["shared"] == {axis}
    assert len(limits["fitted"]) == 2  # the control: without ylim the axis follows each setting


def test_axis_limits_sit_on_a_ladder_of_round_numbers():
    from gradnorm.teach.views import nice_ceiling

    assert [nice_ceiling(x) for x in (0.0, 1.0, 1.1, 2.0, 3.58, 9.3, 20.1)] == [1.0, 1.0, 1.25, 2.0, 4.0, 10.0, 25.0]
    assert nice_ceiling(1.3e-16) == pytest.approx(1.5e-16)
    ladder = {nice_ceiling(x) for x in np.linspace(1, 100, 1000)}
    assert len(ladder) == 21  # two decades of 1 .. 8 steps, and 100: few states for the axis cache
