"""Drawing the length-bias views of ``gradnorm.teach.lengthbias`` (notebook 04) on Axes the caller owns.

Like ``gradnorm.teach.plotting``: every function takes an ``Axes`` (or a ``Figure`` for the
multi-panel views), draws, and returns the artists it made, so tests can read bar heights and
line data instead of pixels. Colours and markers come from ``gradnorm.teach.palette``; the explorer's
picture (correct against wrong responses) is ``gradnorm.teach.views.CorrectVsWrongView``.
"""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from gradnorm.teach.lengthbias import BatchDependence, LengthWeights
from gradnorm.teach.palette import MODE_COLORS, MODE_MARKERS, mode_label


def plot_length_weights(
    ax_token: Axes, ax_share: Axes, view: LengthWeights
) -> dict[str, tuple[Line2D, Line2D]]:
    """Per-token weight (times N, so ``token`` reads 1) and share of the update against length."""
    order = np.argsort(view.lengths, kind="stable")
    n_tokens = view.lengths.sum()
    out = {}
    for mode in view.token_weight:
        style = {"color": MODE_COLORS[mode], "marker": MODE_MARKERS[mode], "ms": 4, "label": mode_label(mode)}
        if mode == "token":  # wide and pale, so that the constant's line (same shares) shows on top
            style.update(lw=5, alpha=0.45)
        if mode == "group":  # not a function of length alone: it depends on the response's prompt group
            style["ls"] = "none"
        out[mode] = (ax_token.plot(view.lengths[order], view.token_weight[mode][order] * n_tokens, **style)[0],
                     ax_share.plot(view.lengths[order], view.share(mode)[order], **style)[0])
    ax_token.set_title("weight of one token (x N)")
    ax_token.set_xlabel("response length |o_i|")
    ax_token.set_ylabel("w x N  (token mode = 1)")
    ax_share.set_title("the response's share of the update")
    ax_share.set_xlabel("response length |o_i|")
    ax_share.set_ylabel("|o_i| w / sum of all weights")
    ax_token.legend(fontsize="small")
    return out


def plot_group_shares(ax: Axes, view: LengthWeights) -> dict[str, BarContainer]:
    """Each prompt group's share of the update under each mode (grouped bars, one per group)."""
    modes = list(view.token_weight)
    num_groups = int(view.group_ids.max()) + 1
    width = 0.8 / len(modes)
    x = np.arange(num_groups)
    out = {}
    for k, mode in enumerate(modes):
        out[mode] = ax.bar(x + k * width, view.group_share(mode), width, color=MODE_COLORS[mode], label=mode)
    tokens = np.bincount(view.group_ids, weights=view.lengths).astype(int)
    ax.set_xticks(x + width * (len(modes) - 1) / 2, [f"prompt {g}\n{t} tokens" for g, t in enumerate(tokens)])
    ax.set_ylabel("share of the update")
    ax.set_title("each prompt group's share", fontsize="medium")
    ax.legend(fontsize="small")
    return out


def length_weights_view(fig: Figure, view: LengthWeights, tight: bool = True) -> dict:
    """Notebook 04's first picture: weight per token and per response against length, per prompt."""
    ax_token, ax_share, ax_groups = fig.subplots(1, 3)
    lines = plot_length_weights(ax_token, ax_share, view)
    groups = plot_group_shares(ax_groups, view)
    if tight:  # a full text-layout pass; widgets compute it once and reuse it (widgets.Explorer)
        fig.tight_layout()
    return {"lines": lines, "groups": groups}


def plot_batch_dependence(ax: Axes, view: BatchDependence) -> dict[str, Line2D]:
    """The per-token weight of one fixed response against the length of every other response."""
    out = {}
    for mode, w in view.token_weight.items():
        out[mode] = ax.plot(view.other_length, w, color=MODE_COLORS[mode], marker=MODE_MARKERS[mode], ms=4,
                            label=mode_label(mode))[0]
    ax.set_yscale("log")
    ax.set_xlabel("length of every other response in the minibatch")
    ax.set_ylabel("weight of one token of the fixed response")
    ax.set_title(f"a response of {view.own_length} tokens: does its weight depend on the others?", fontsize="medium")
    ax.legend(fontsize="small")
    return out
