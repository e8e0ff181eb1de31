"""Sliders wired to the in-place views of ``gradnorm.teach.views``: the notebooks' explorers, drivable without a browser.

An ``Explorer`` holds the controls, a text readout and the view's figure rendered as a PNG
image. Its figure is built once; a change of a control recomputes the data (``gradnorm.teach.imbalance``,
``gradnorm.teach.sweeps``, ``gradnorm.teach.lengthbias``), moves the view's artists in place and re-renders
only what changed (``gradnorm.teach.canvas.BlitCanvas``), so a callback costs milliseconds, not a new
figure. Tests set a control's ``value`` (or call ``update(**values)``) and read ``artists``
(bars, lines) and ``readout.value``; a browser sees the image and the readout change; a reader
without a kernel sees the stills a notebook prints with ``image.value`` and ``text``.

    from gradnorm.teach.widgets import token_imbalance_explorer
    token_imbalance_explorer()          # the last expression of a notebook cell displays it
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Sequence

import ipywidgets as widgets
import numpy as np
from matplotlib.figure import Figure

from gradnorm.teach import views
from gradnorm.teach.canvas import BlitCanvas
from gradnorm.teach.imbalance import ShardedBatch, imbalanced_minibatch, token_layout
from gradnorm.teach.lengthbias import correct_vs_wrong
from gradnorm.core.modes import INVARIANT_MODES, MODE_NAMES
from gradnorm.teach.palette import MODE_COLORS
from gradnorm.core.sharding import SHARD_KINDS
from gradnorm.teach.sweeps import GradientSweep, gradient_sweep

Draw = Callable[..., tuple[dict, str]]  # draw(**values) -> (artists, readout html), moving the view's artists


class Explorer:
    """Controls, a readout and a figure whose artists move in place whenever a control changes."""

    def __init__(self, controls: dict[str, widgets.ValueWidget], figure: Figure, dynamic, draw: Draw):
        self.controls = controls
        self.figure = figure
        self._draw = draw
        self.readout = widgets.HTML(layout=widgets.Layout(min_height="2.5em"))
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%"))
        self.box = widgets.VBox([widgets.HBox(list(controls.values())), self.readout, self.image])
        self.artists, text = draw(**self.values)
        figure.tight_layout()  # once: the margins then stay, so the picture does not jump between values
        self.canvas = BlitCanvas(figure, dynamic)
        self._holding = False
        for control in controls.values():
            control.observe(lambda _change: self._holding or self.redraw(), names="value")
        self._show(text)

    @property
    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    @property
    def text(self) -> str:
        """The readout as plain text, as a browser shows it."""
        return as_text(self.readout.value)

    def redraw(self) -> None:
        self.artists, text = self._draw(**self.values)
        self._show(text)

    def _show(self, text: str) -> None:
        self.image.value = self.canvas.png()
        self.readout.value = text

    def update(self, **values) -> dict:
        """Set several controls at once (one redraw) and return the new artists."""
        self._holding = True
        try:
            for name, value in values.items():
                self.controls[name].value = value
        finally:
            self._holding = False
        self.redraw()
        return self.artists

    def _repr_mimebundle_(self, **kwargs):  # display(explorer) shows the widget box
        return self.box._repr_mimebundle_(**kwargs)


def as_text(markup: str) -> str:
    """What a browser shows of a readout's HTML, whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", re.sub(r"<br\s*/?>", " ", markup))).split())


_STYLE = {"description_width": "initial"}


def _int_slider(description: str, value: int, low: int, high: int) -> widgets.IntSlider:
    return widgets.IntSlider(value=value, min=low, max=high, description=description, style=_STYLE,
                             continuous_update=False)


def _colored(mode: str) -> str:
    return f"<span style='color:{MODE_COLORS[mode]}'>{mode}</span>"


# ---------------------------------------------------------------------------------------------
# Notebook 01: token imbalance without a model
# ---------------------------------------------------------------------------------------------

FULL_LENGTH = 24  # tokens per response in a full microbatch of the explorer
IMBALANCES = (1, 2, 3, 4, 6, 8, 12, 24)  # the divisors of FULL_LENGTH: every imbalance is an exact ratio


def token_imbalance_batch(world_size: int, accum_steps: int, imbalance: int) -> ShardedBatch:
    """The explorer's minibatch: responses of 24 tokens, rank 0's first microbatch 24 / imbalance."""
    if FULL_LENGTH % imbalance:
        raise ValueError(f"imbalance must divide {FULL_LENGTH} (one of {IMBALANCES}), got {imbalance}")
    return imbalanced_minibatch(world_size, accum_steps, imbalance, full_length=FULL_LENGTH)


def describe_token_imbalance(batch: ShardedBatch, artists: dict) -> str:
    """The readout: tokens per microbatch, rank 0's shares, and what a short-microbatch token weighs."""
    local, token = artists["shares"]["local"], artists["shares"]["token"]
    tokens = batch.microbatch_tokens()
    lay = artists["layout"]["local"]
    n = float(lay.length.sum())
    short, full = lay.weight[0], lay.weight[-1]
    per_mb = " | ".join(f"rank {r}: " + ", ".join(map(str, row)) for r, row in enumerate(tokens[:4]))
    more = " | ..." if len(tokens) > 4 else ""
    vs_full = (f"{short / full:.2f}x a token of a full microbatch and " if batch.world_size * batch.accum_steps > 1
               else "")
    return (
        f"Tokens per microbatch: {per_mb}{more} (N = {int(n)}).<br>"
        f"<b>rank 0 holds {local.tokens[0]:.0%} of the tokens: {local.update[0]:.0%} of the update</b> under "
        f"{_colored('local')}, {token.update[0]:.0%} of the update under {_colored('token')}. "
        f"Under local a token of rank 0's first microbatch weighs {vs_full}{short * n:.2f}x its correct weight 1/N."
    )


def token_imbalance_explorer(world_size: int = 2, accum_steps: int = 2, imbalance: int = 4,
                             fit_axis: bool = False) -> Explorer:
    """Sliders for W, A and the imbalance of rank 0's first microbatch (notebook 01). The height axis
    is one for every frame the sliders can make, so that frames compare; ``fit_axis`` fits it to each
    frame instead (static stills, where the one axis would flatten the default's bars)."""
    controls = {
        "world_size": _int_slider("ranks W", world_size, 1, 8),
        "accum_steps": _int_slider("accumulation steps A", accum_steps, 1, 8),
        "imbalance": widgets.SelectionSlider(options=list(IMBALANCES), value=imbalance, description="imbalance",
                                             continuous_update=False, style=_STYLE),
    }
    fig = Figure(figsize=(13, 3.8), dpi=80)
    # One height axis for every frame, so that frames compare: up to the tallest bar the sliders can make,
    # a token of the short microbatch at W = A = 8 and imbalance 24 (the taller the more microbatches).
    tallest = token_layout(token_imbalance_batch(8, 8, max(IMBALANCES)), "local")
    ymax = views.nice_ceiling(1.05 * float(tallest.weight.max() * tallest.length.sum()))
    view = views.ImbalanceView(fig, max_sequences=8 * 8 * 2, max_ranks=8, ymax=None if fit_axis else ymax)

    def draw(world_size: int, accum_steps: int, imbalance: int) -> tuple[dict, str]:
        batch = token_imbalance_batch(world_size, accum_steps, imbalance)
        artists = view.update(batch)
        artists["batch"] = batch
        return artists, describe_token_imbalance(batch, artists)

    return Explorer(controls, fig, view.dynamic, draw)


# ---------------------------------------------------------------------------------------------
# Notebook 02: real gradients
# ---------------------------------------------------------------------------------------------


def gradient_explorer(
    spreads: Sequence[float], mode: str = "local", shard: str = "length", world_size: int = 2, accum_steps: int = 2,
    sweeps: dict[str, GradientSweep] | None = None,
) -> Explorer:
    """Pick a mode, a sharding and a spread k; see the microbatch tokens and the gradient error.

    Each sharding's sweep (all modes) is computed once, on first use; pass ``sweeps`` already
    computed by ``gradnorm.teach.sweeps.gradient_sweep`` with the same settings to reuse them.
    """
    sweeps = dict(sweeps or {})
    fig = Figure(figsize=(14, 3.8), dpi=80)
    view = views.GradientView(fig, spreads, world_size, accum_steps)

    def draw(mode: str, shard: str, spread: float) -> tuple[dict, str]:
        if shard not in sweeps:
            sweeps[shard] = gradient_sweep(spreads, shard=shard, world_size=world_size, accum_steps=accum_steps)
        sweep = sweeps[shard]
        artists = view.update(sweep, mode, spread)
        artists["sweep"] = sweep
        k = artists["index"]
        tokens = sweep.microbatch_tokens[k]
        text = (f"{shard} sharding, spread k = {sweep.x[k]:g}: microbatches hold {tokens.min()} to "
                f"{tokens.max()} tokens.<br><b>{_colored(mode)}: relative error {sweep.relative_error[mode][k]:.3g}, "
                f"cosine {sweep.cosine[mode][k]:.4f}</b> against the full-batch gradient.")
        return artists, text

    controls = {
        "mode": widgets.Dropdown(options=list(MODE_NAMES), value=mode, description="mode"),
        "shard": widgets.Dropdown(options=list(SHARD_KINDS), value=shard, description="sharding"),
        "spread": widgets.SelectionSlider(options=[float(k) for k in spreads], value=float(spreads[-1]),
                                          description="spread k", continuous_update=False, style=_STYLE),
    }
    return Explorer(controls, fig, view.dynamic, draw)


# ---------------------------------------------------------------------------------------------
# Notebook 04: length bias
# ---------------------------------------------------------------------------------------------


def describe_correct_vs_wrong(view) -> str:
    def down_vs_up(mode: str) -> float:
        up, down = view.push_per_token[mode]
        return abs(down) / up

    others = ("token", "group", "constant")
    # The advantages themselves: the only thing the std changes, and why the shares do not move
    # with the number correct (they sum to zero over the group).
    return (f"Advantages: {view.advantage_correct:+.3f} for a correct response, {view.advantage_wrong:+.3f} for a "
            f"wrong one. N = {view.tokens} tokens; pushes in units of 1/N. A wrong token is pushed down "
            f"<b>{down_vs_up('sequence'):.2f}x</b> as hard as a correct token is pushed up under sequence, "
            + ", ".join(f"{down_vs_up(m):.2f}x under {m}" for m in others)
            + f". Correct responses get <b>{view.update_share['sequence'][0]:.0%}</b> of the update under sequence, "
            + ", ".join(f"{view.update_share[m][0]:.0%} under {m}" for m in others) + ".")


def length_bias_explorer(correct_len: int = 10, wrong_len: int = 40, num_correct: int = 4, group_size: int = 8,
                         max_new_tokens: int = 64, scale_by_std: bool = True,
                         ylim: tuple[float, float] | None = None) -> Explorer:
    """Lengths of correct and wrong responses in one prompt group, and how many are correct (notebook 04).
    ``ylim`` fixes the push axis, e.g. ``views.push_axis`` of a set of stills; without it the axis fits
    each setting."""
    controls = {
        "correct_len": _int_slider("correct length", correct_len, 1, max_new_tokens),
        "wrong_len": _int_slider("wrong length", wrong_len, 1, max_new_tokens),
        "num_correct": _int_slider("correct of " + str(group_size), num_correct, 1, group_size - 1),
        "scale_by_std": widgets.Checkbox(value=scale_by_std, description="divide advantages by the group std"),
    }
    fig = Figure(figsize=(12, 4), dpi=80)
    view = views.CorrectVsWrongView(fig, INVARIANT_MODES, ylim)

    def draw(correct_len: int, wrong_len: int, num_correct: int, scale_by_std: bool) -> tuple[dict, str]:
        data = correct_vs_wrong(correct_len, wrong_len, num_correct, group_size, max_new_tokens=max_new_tokens,
                                scale_by_std=scale_by_std)
        artists = view.update(data)
        artists["view"] = data
        return artists, describe_correct_vs_wrong(data)

    return Explorer(controls, fig, view.dynamic, draw)


def bar_heights(bars) -> np.ndarray:
    """The heights of a BarContainer or a list of bars, for tests and readouts."""
    return np.array([b.get_height() for b in bars])
