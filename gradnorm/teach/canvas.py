"""A figure that redraws only what changes: the in-place canvas behind the notebooks' explorers.

Drawing a whole matplotlib figure lays out and rasterizes every tick label, title and legend,
tens of milliseconds; moving a slider changes a few bars, a line and one axis. So an explorer's
figure is drawn once without its *dynamic* artists (marked animated, which matplotlib's draw
skips), that picture is kept, and every frame restores it, draws the dynamic artists over it
(blitting) and encodes the pixels as a PNG.

An ``Axis`` can be dynamic too, for an axis whose limits follow the data. Drawing its ticks and
labels costs as much as the rest of a frame, and a view keeps its limits on a ladder of round
numbers, so each axis visits few states: the pixels of an axis (its region outside the axes:
tick marks, tick labels, label) are drawn once per state and pasted from a cache afterwards.

The safety net: the static state of the figure (limits, ticks and labels of every axis that is
not dynamic, titles, axes positions) is compared with the one the kept picture was drawn with;
if a view changed something it did not declare dynamic, the whole figure is drawn again
(``full_redraws`` counts those), so the picture is never stale, only slower.

    canvas = BlitCanvas(fig, dynamic=[bars, line, ax.yaxis])
    png = canvas.png()      # after changing the dynamic artists in place
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox


class BlitCanvas:
    """Renders ``figure`` to PNG bytes, redrawing only its dynamic artists between frames."""

    def __init__(self, figure: Figure, dynamic: Sequence[Artist] = (), blit: bool = True):
        self.figure = figure
        self.canvas = FigureCanvasAgg(figure)
        self.blit = blit  # False: draw the whole figure every frame (the benchmark's baseline)
        self.full_redraws = 0
        self._background = None
        self._key: tuple | None = None
        self._axis_cache: dict[tuple, object] = {}  # (axis, its state) -> the pixels of its region
        self.axis_draws = 0  # axis states drawn (cache misses), for the benchmark
        self.dynamic: list[Artist] = []
        self.set_dynamic(dynamic)

    def set_dynamic(self, artists: Sequence[Artist]) -> None:
        """Artists drawn every frame, in this order, over the kept picture (which leaves them out)."""
        for artist in self.dynamic:
            artist.set_animated(False)
        self.dynamic = list(artists)
        for artist in self.dynamic:
            artist.set_animated(True)
        self._background = None
        self._axis_cache.clear()

    def render(self) -> np.ndarray:
        """(H, W, 4) uint8: the figure as it is now."""
        key = self._static_key()
        if self._background is None or key != self._key or not self.blit:
            self.canvas.draw()  # everything but the dynamic artists
            self._background = self.canvas.copy_from_bbox(self.figure.bbox)
            self._key = key
            self._axis_cache.clear()
            self.full_redraws += 1
        else:
            self.canvas.restore_region(self._background)
        renderer = self.canvas.get_renderer()
        axes = [a for a in self.dynamic if isinstance(a, Axis)]  # their regions first: spines go over them
        for axis in axes:
            self._paste_axis(axis, renderer)
        for artist in self.dynamic:
            if artist.get_visible() and not isinstance(artist, Axis):
                artist.draw(renderer)
        return np.asarray(self.canvas.buffer_rgba())

    def _paste_axis(self, axis: Axis, renderer) -> None:
        """Paste the axis's pixels for its current state, drawing them once if this state is new."""
        if not axis.get_visible():
            return
        key = (id(axis), _axis_key(axis))
        region = self._axis_cache.get(key) if self.blit else None
        if region is not None:
            self.canvas.restore_region(region)
            return
        axis.draw(renderer)
        self.axis_draws += 1
        if self.blit:
            if len(self._axis_cache) >= MAX_CACHED_AXIS_STATES:
                self._axis_cache.pop(next(iter(self._axis_cache)))  # the oldest
            self._axis_cache[key] = self.canvas.copy_from_bbox(_axis_region(axis, renderer, self.figure))

    def png(self) -> bytes:
        """The figure as PNG bytes."""
        return encode_png(self.render())

    def _static_key(self) -> tuple:
        """What the kept picture depends on: every non-dynamic axis's limits, ticks and labels, and texts."""
        dynamic = {id(a) for a in self.dynamic}
        parts: list = [tuple(self.figure.get_size_inches()), tuple(t.get_text() for t in self.figure.texts)]
        for ax in self.figure.axes:
            parts.append((ax.get_position().bounds, ax.get_title("left"), ax.get_title(), ax.get_visible()))
            for axis in (ax.xaxis, ax.yaxis):
                if id(axis) not in dynamic:
                    parts.append(_axis_key(axis))
        return tuple(parts)


MAX_CACHED_AXIS_STATES = 256


def encode_png(rgba: np.ndarray) -> bytes:
    """(H, W, 4) uint8 -> an RGBA PNG, written for speed rather than size.

    Pillow's encoder tries several row filters on every row; a plot is mostly flat colour, which
    zlib's fastest level compresses well with no filter at all (about 45 kB for a 1040 x 304
    frame), in about half the time.
    """
    height, width = rgba.shape[:2]
    rows = np.empty((height, 1 + 4 * width), np.uint8)
    rows[:, 0] = 0  # filter type 0 (none) on every row
    rows[:, 1:] = rgba.reshape(height, -1)
    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)  # 8-bit RGBA, no interlace
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 1))
            + _chunk(b"IEND", b""))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _axis_region(axis: Axis, renderer, figure: Figure) -> Bbox:
    """Pixels an axis draws: its tight box (tick labels, label, offset text) stretched to the spine."""
    tight = axis.get_tightbbox(renderer)
    frame = axis.axes.bbox
    if axis.axis_name == "y":
        side = Bbox.from_extents(min(tight.x0, frame.x0), frame.y0, frame.x0, frame.y1) if tight.x1 <= frame.x1 \
            else Bbox.from_extents(frame.x1, frame.y0, max(tight.x1, frame.x1), frame.y1)
    else:
        side = Bbox.from_extents(frame.x0, min(tight.y0, frame.y0), frame.x1, frame.y0) if tight.y1 <= frame.y1 \
            else Bbox.from_extents(frame.x0, frame.y1, frame.x1, max(tight.y1, frame.y1))
    region = Bbox.union([tight, side]).padded(2)
    return Bbox.intersection(region, figure.bbox) or figure.bbox


def _axis_key(axis: Axis) -> tuple:
    locs = axis.get_majorticklocs()
    labels = axis.get_major_formatter().format_ticks(locs)
    return (tuple(axis.get_view_interval()), tuple(locs), tuple(labels), axis.get_label_text(), axis.get_visible())
