"""The one palette of the notebooks and figures: a colour per mode, a colour per rank, a style per sharding.

Every drawing module (``plotting``, ``lengthplots``, ``auditplot``, the explorers of ``widgets``)
takes its colours from here, so a colour means the same thing in every panel of every notebook:

- a **mode** (how the loss is normalized) is a saturated colour: ``local`` red, ``token`` blue,
  ``sequence`` orange, ``group`` green, ``constant`` purple; each also has a marker, so that
  curves lying on top of one another stay distinguishable;
- a **rank** is an earthy colour (brown, olive, pink, teal, then their light shades), never
  one of the modes';
- a **sharding** is a line style and a marker, never a colour (the colour stays the mode's);
- a **share of the tokens** is grey, wherever it is drawn.
"""

from __future__ import annotations

from gradnorm.core.modes import PAPER_OF_MODE

MODE_COLORS = {"local": "#d62728", "token": "#1f77b4", "sequence": "#ff7f0e", "group": "#2ca02c",
               "constant": "#9467bd", "pair": "#1f77b4"}  # pair: DPO's mean over all pairs (token's rule)
# Markers of decreasing size read as concentric rings where exact modes coincide (notebook 02).
MODE_MARKERS = {"local": "o", "token": "o", "sequence": "s", "group": "^", "constant": "D", "pair": "o"}
MODE_MARKER_SIZES = {"local": 4, "token": 9, "sequence": 7, "group": 5, "constant": 3, "pair": 5}
TOKENS_COLOR = "#9a9a9a"  # a share of the tokens
NEUTRAL_COLOR = "#4d4d4d"  # a share of the update under a loss that is none of the modes
RANK_COLORS = ["#8c564b", "#bcbd22", "#e377c2", "#17becf", "#c49c94", "#dbdb8d", "#f7b6d2", "#9edae5"]
SHARD_STYLES = {"length": {"ls": "-", "marker": "o"}, "balanced": {"ls": "--", "marker": "s"},
                "interleave": {"ls": ":", "marker": "^"}, "contiguous": {"ls": "-.", "marker": "D"}}
WEIGHT_CMAP = "RdBu_r"  # w x N on a log scale, read with its colour bar: white = 1/N (notebook 06)
PADDING_COLOR = "#bdbdbd"  # tokens outside the mask, dark enough that white (1/N) tokens stand out


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def mode_label(mode: str) -> str:
    """'sequence (DeepSeekMath GRPO)': the mode and who uses it."""
    return f"{mode} ({PAPER_OF_MODE[mode]})" if mode in ("sequence", "token", "constant") else mode


def mode_style(mode: str) -> dict:
    """Line style of a mode's curve: its colour and marker; the exact modes dashed, ``local`` solid."""
    return {"color": MODE_COLORS[mode], "marker": MODE_MARKERS[mode], "ms": MODE_MARKER_SIZES[mode],
            "ls": "-" if mode == "local" else "--", "mfc": "none" if mode != "local" else MODE_COLORS[mode]}
