"""Sliders wired to ``gradnorm.plotting``: the notebooks' explorers, drivable without a browser.

An ``Explorer`` holds the controls, a text readout and the figure rendered as a PNG image; every
change of a control recomputes the view from ``gradnorm.imbalance``, ``gradnorm.sweeps`` or
``gradnorm.lengthbias`` and redraws. Tests set a
control's ``value`` (or call ``update(**values)``) and read ``artists`` (bars, lines) and
``readout.value``; a browser sees the image and the readout change.

    from gradnorm.widgets import token_imbalance_explorer
    token_imbalance_explorer()          # the last expression of a notebook cell displays it
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

import ipywidgets as widgets
import numpy as np
from matplotlib.figure import Figure

from gradnorm import lengthplots, plotting
from gradnorm.imbalance import Minibatch, imbalanced_minibatch, weight_ratio
from gradnorm.lengthbias import correct_vs_wrong
from gradnorm.modes import MODE_NAMES
from gradnorm.sharding import SHARD_KINDS
from gradnorm.sweeps import GradientSweep, gradient_sweep

Draw = Callable[..., tuple[dict, str]]  # draw(fig, **values) -> (artists, readout html)


class Explorer:
    """Controls, a readout and a figure that is redrawn from scratch whenever a control changes."""

    def __init__(
        self, controls: dict[str, widgets.ValueWidget], draw: Draw, figsize: tuple[float, float], dpi: int = 80,
        reuse_margins: bool = True,
    ):
        self.controls = controls
        self._draw, self._figsize, self._dpi = draw, figsize, dpi
        self.readout = widgets.HTML(layout=widgets.Layout(min_height="2.5em"))
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%"))
        self.box = widgets.VBox([widgets.HBox(list(controls.values())), self.readout, self.image])
        self.figure: Figure | None = None
        self.artists: dict = {}
        self.reuse_margins = reuse_margins
        self._margins: dict | None = None  # tight_layout's result on the first draw, reused after
        self._holding = False
        for control in controls.values():
            control.observe(lambda _change: self._holding or self.redraw(), names="value")
        self.redraw()

    @property
    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def redraw(self) -> None:
        fig = Figure(figsize=self._figsize)
        self.artists, text = self._draw(fig, **self.values)  # views are drawn with tight=False
        # tight_layout lays out every label once more (about as slow as rendering the PNG), and the
        # margins barely move between slider values: compute them on the first draw only.
        if self._margins is None or not self.reuse_margins:
            fig.tight_layout()
            params = fig.subplotpars
            self._margins = {k: getattr(params, k) for k in ("left", "right", "bottom", "top", "wspace", "hspace")}
        else:
            fig.subplots_adjust(**self._margins)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=self._dpi)
        self.figure = fig
        self.image.value = buffer.getvalue()
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


_STYLE = {"description_width": "initial"}


def _int_slider(description: str, value: int, low: int, high: int) -> widgets.IntSlider:
    return widgets.IntSlider(value=value, min=low, max=high, description=description, style=_STYLE,
                             continuous_update=False)


# ---------------------------------------------------------------------------------------------
# Notebook 01: token imbalance without a model
# ---------------------------------------------------------------------------------------------

FULL_LENGTH = 24  # tokens per sequence in a full microbatch of the explorer (24 divides by 1..4, 6, 8, 12)


def draw_token_imbalance(fig: Figure, world_size: int, accum_steps: int, imbalance: float) -> tuple[dict, str]:
    """Per-token weights under local and token, and rank shares, for ``imbalanced_minibatch``."""
    batch = imbalanced_minibatch(world_size, accum_steps, imbalance, full_length=FULL_LENGTH)
    artists = plotting.imbalance_view(fig, batch, ("local", "token"), tight=False)
    artists["batch"] = batch
    return artists, describe_token_imbalance(batch, artists)


def describe_token_imbalance(batch: Minibatch, artists: dict) -> str:
    local, token = artists["shares"]["local"], artists["shares"]["token"]
    tokens = batch.microbatch_tokens()
    ratio = weight_ratio(artists["layout"]["local"])
    per_mb = " | ".join(f"rank {r}: " + ", ".join(map(str, row)) for r, row in enumerate(tokens[:4]))
    more = " | ..." if len(tokens) > 4 else ""
    return (
        f"Tokens per microbatch: {per_mb}{more}.<br>"
        f"<b>rank 0: {local.update[0]:.0%} of the update for {local.tokens[0]:.0%} of the tokens</b> under "
        f"<span style='color:{plotting.MODE_COLORS['local']}'>local</span>; "
        f"{token.update[0]:.0%} under <span style='color:{plotting.MODE_COLORS['token']}'>token</span>. "
        f"Under local a token of the short microbatch weighs {ratio:.1f}x a token of a full one (token: 1.0x)."
    )


def token_imbalance_explorer(world_size: int = 2, accum_steps: int = 2, imbalance: int = 4) -> Explorer:
    """Sliders for W, A and the imbalance of rank 0's first microbatch (notebook 01)."""
    controls = {
        "world_size": _int_slider("ranks W", world_size, 1, 8),
        "accum_steps": _int_slider("accumulation steps A", accum_steps, 1, 8),
        "imbalance": _int_slider("imbalance", imbalance, 1, FULL_LENGTH),
    }
    return Explorer(controls, draw_token_imbalance, figsize=(13, 3.8))


# ---------------------------------------------------------------------------------------------
# Notebook 02: real gradients
# ---------------------------------------------------------------------------------------------


def gradient_explorer(
    imbalances: Sequence[float], mode: str = "local", shard: str = "length", world_size: int = 2, accum_steps: int = 2,
    sweeps: dict[str, GradientSweep] | None = None,
) -> Explorer:
    """Pick a mode, a sharding and an imbalance; see the microbatch tokens and the gradient error.

    Each sharding's sweep (all modes) is computed once, on first use; pass ``sweeps`` already
    computed by ``gradnorm.sweeps.gradient_sweep`` with the same settings to reuse them.
    """
    sweeps = dict(sweeps or {})

    def draw(fig: Figure, mode: str, shard: str, imbalance: float) -> tuple[dict, str]:
        if shard not in sweeps:
            sweeps[shard] = gradient_sweep(imbalances, shard=shard, world_size=world_size, accum_steps=accum_steps)
        sweep = sweeps[shard]
        artists = plotting.gradient_view(fig, sweep, mode, imbalance, tight=False)
        artists["sweep"] = sweep
        k = artists["index"]
        tokens = sweep.microbatch_tokens[k]
        text = (f"{shard} sharding, imbalance {sweep.imbalance[k]:g}: microbatches hold {tokens.min()} to "
                f"{tokens.max()} tokens.<br><b>{mode}: relative error {sweep.relative_error[mode][k]:.3g}, "
                f"cosine {sweep.cosine[mode][k]:.4f}</b> against the full-batch gradient.")
        return artists, text

    controls = {
        "mode": widgets.Dropdown(options=list(MODE_NAMES), value=mode, description="mode"),
        "shard": widgets.Dropdown(options=list(SHARD_KINDS), value=shard, description="sharding"),
        "imbalance": widgets.SelectionSlider(options=[float(k) for k in imbalances], value=float(imbalances[-1]),
                                             description="imbalance", continuous_update=False, style=_STYLE),
    }
    return Explorer(controls, draw, figsize=(14, 3.8))


# ---------------------------------------------------------------------------------------------
# Notebook 04: length bias
# ---------------------------------------------------------------------------------------------


def draw_correct_vs_wrong(
    fig: Figure, correct_len: int, wrong_len: int, num_correct: int, scale_by_std: bool = True,
    group_size: int = 8, max_new_tokens: int = 64,
) -> tuple[dict, str]:
    view = correct_vs_wrong(correct_len, wrong_len, num_correct, group_size, max_new_tokens=max_new_tokens,
                            scale_by_std=scale_by_std)
    artists = lengthplots.correct_vs_wrong_view(fig, view, tight=False)
    artists["view"] = view

    def down_vs_up(mode: str) -> float:
        up, down = view.push_per_token[mode]
        return abs(down) / up

    text = (f"A wrong token is pushed down <b>{down_vs_up('sequence'):.2f}x</b> as hard as a correct token is "
            f"pushed up under sequence, {down_vs_up('token'):.2f}x under token and constant. Correct responses get "
            f"<b>{view.update_share['sequence'][0]:.0%}</b> of the update under sequence, "
            f"<b>{view.update_share['token'][0]:.0%}</b> under token.")
    return artists, text


def length_bias_explorer(correct_len: int = 10, wrong_len: int = 40, num_correct: int = 4, group_size: int = 8,
                         max_new_tokens: int = 64) -> Explorer:
    """Lengths of correct and wrong responses in one prompt group, and how many are correct (notebook 04)."""
    controls = {
        "correct_len": _int_slider("correct length", correct_len, 1, max_new_tokens),
        "wrong_len": _int_slider("wrong length", wrong_len, 1, max_new_tokens),
        "num_correct": _int_slider("correct of " + str(group_size), num_correct, 1, group_size - 1),
        "scale_by_std": widgets.Checkbox(value=True, description="divide advantages by the group std"),
    }

    def draw(fig: Figure, **values) -> tuple[dict, str]:
        return draw_correct_vs_wrong(fig, group_size=group_size, max_new_tokens=max_new_tokens, **values)

    return Explorer(controls, draw, figsize=(12, 4))


def bar_heights(bars) -> np.ndarray:
    """The heights of a BarContainer, for tests and readouts."""
    return np.array([b.get_height() for b in bars])
