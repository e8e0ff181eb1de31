"""Key press to redrawn pixels in the browser: the in-place canvas against ipympl, side by side.

    pip install ipympl                              # the candidate; the notebooks do not need it
    python benchmarks/canvas_latency.py             # prints the table (about two minutes)
    python benchmarks/canvas_latency.py --presses 20 --out benchmarks   # also writes canvas_latency.md

One JupyterLab and one Chromium, started as tests/notebooks/test_browser.py starts them (its helpers), run
a scratch notebook holding notebook 01's token-imbalance figure three times, each under its own
"imbalance" slider:

- ``canvas``: ``gradnorm.teach.widgets.token_imbalance_explorer()`` as the notebook shows it:
  the kernel moves the artists, ``BlitCanvas`` redraws what changed and encodes a PNG, an
  ipywidgets ``Image`` carries it to the page;
- ``ipympl``: the same view (``gradnorm.teach.views.ImbalanceView``, the same figure size and dpi)
  on an ipympl figure (``%matplotlib widget``): the same slider callback moves the same artists,
  then ``fig.canvas.draw_idle()``; ipympl draws the figure with Agg and sends the changed pixels
  to its canvas element in the page;
- ``blit``: the same ipympl figure redrawn with matplotlib's own blitting recipe (the dynamic
  artists animated, a kept background, ``restore_region``, ``draw_artist``, ``canvas.blit``), the
  maintained path nearest to what ``BlitCanvas`` does by hand.

What is timed, in the page itself (``performance.now()``): from the keydown event of an ArrowRight
or ArrowLeft on the focused slider handle to the first moment new pixels are there: the ``load``
event of the new ``<img>`` (canvas) or the first ``drawImage`` onto a canvas element (ipympl, which
draws each image it receives). Both include the comm message to the kernel, the same data and view
update, the render, the transfer and the decode. Presses rotate over the three figures, each
toggling its slider between two values, and every press waits until the kernel is idle and the
page quiet, so one press never overlaps the next. The same script also times the kernel side
alone, in this process: ``BlitCanvas.png()`` against a full Agg draw plus a PNG of it (ipympl's
work per frame), and the PNG encoder alone (``canvas.encode_png`` against Pillow's, at its default
and at its fastest compression) on the same 1040 x 304 frame.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.notebooks import test_browser as tb  # noqa: E402  (the server, the page and the waits)

SETUP = """\
import ipywidgets as widgets
import matplotlib.pyplot as plt
%matplotlib widget
from IPython.display import display
from gradnorm.teach import views
from gradnorm.teach.widgets import IMBALANCES, token_imbalance_batch, token_imbalance_explorer
"""
CANVAS = """\
explorer = token_imbalance_explorer()
explorer.controls["imbalance"].description = "imbalance canvas"
explorer
"""
IPYMPL = """\
plt.ioff()
fig = plt.figure(figsize=(13, 3.8), dpi=80)  # token_imbalance_explorer's figure
view = views.ImbalanceView(fig, max_sequences=8 * 8 * 2, max_ranks=8)
slider = widgets.SelectionSlider(options=list(IMBALANCES), value=4, description="imbalance ipympl",
                                 continuous_update=False, style={"description_width": "initial"})

def draw(change=None):
    view.update(token_imbalance_batch(2, 2, slider.value))
    fig.canvas.draw_idle()

draw()
fig.tight_layout()
fig.canvas.header_visible = fig.canvas.footer_visible = fig.canvas.toolbar_visible = False
slider.observe(draw, names="value")
display(widgets.VBox([slider, fig.canvas]))
"""
BLIT = """\
fig2 = plt.figure(figsize=(13, 3.8), dpi=80)
view2 = views.ImbalanceView(fig2, max_sequences=8 * 8 * 2, max_ranks=8)
slider2 = widgets.SelectionSlider(options=list(IMBALANCES), value=4, description="imbalance blit",
                                  continuous_update=False, style={"description_width": "initial"})
view2.update(token_imbalance_batch(2, 2, slider2.value))
fig2.tight_layout()
fig2.canvas.header_visible = fig2.canvas.footer_visible = fig2.canvas.toolbar_visible = False
fig2.canvas.draw_idle()
background = None

def draw2(change=None):  # matplotlib's blitting recipe
    global background
    if background is None:  # once, after the page has sized the canvas: the picture without them...
        for artist in view2.dynamic:
            artist.set_animated(True)
        fig2.canvas.draw()
        background = fig2.canvas.copy_from_bbox(fig2.bbox)
    view2.update(token_imbalance_batch(2, 2, slider2.value))
    fig2.canvas.restore_region(background)  # ...and the dynamic artists over it, every frame
    for artist in view2.dynamic:
        fig2.draw_artist(artist)
    fig2.canvas.blit(fig2.bbox)

slider2.observe(draw2, names="value")
display(widgets.VBox([slider2, fig2.canvas]))
"""
# Timestamps in the page: every keydown, every <img> load, every drawImage onto a canvas element.
INIT = """
window.__t = {key: [], img: [], draw: []};
document.addEventListener('keydown', () => window.__t.key.push(performance.now()), true);
document.addEventListener('load', e => { if (e.target.tagName === 'IMG') window.__t.img.push(performance.now()); }, true);
const drawImage = CanvasRenderingContext2D.prototype.drawImage;
CanvasRenderingContext2D.prototype.drawImage = function (...args) {
  window.__t.draw.push(performance.now());
  return drawImage.apply(this, args);
};
"""
QUIET = """({quietMs}) => {""" + tb._JS_PANEL + """
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const t = window.__t, n = t.img.length + t.draw.length;
  const now = performance.now();
  if (window.__quiet === undefined || window.__quiet.n !== n) { window.__quiet = {n, since: now}; return false; }
  return kernel.status === 'idle' && now - window.__quiet.since >= quietMs;
}"""
EVENT = {"canvas": "img", "ipympl": "draw", "blit": "draw"}  # one figure redraws at a time: no other draws


def write_notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (SETUP, CANVAS, IPYMPL, BLIT)]
    nbformat.write(nb, path)


def press_and_time(page, which: str, key: str) -> float:
    """Milliseconds from the keydown to the first new pixels of ``which``'s figure."""
    label = page.locator(".widget-label", has_text=re.compile(rf"^\s*imbalance {which}\s*$"))
    slider = page.locator(".widget-slider").filter(has=label)
    slider.locator(".noUi-handle").focus()
    page.wait_for_function(QUIET, arg={"quietMs": 500}, polling=50, timeout=60_000)
    page.keyboard.press(key)
    page.wait_for_function("(which) => window.__t[which].some(x => x > window.__t.key.at(-1))", arg=EVENT[which],
                           polling=20, timeout=60_000)
    page.wait_for_function(QUIET, arg={"quietMs": 500}, polling=50, timeout=60_000)  # nothing more follows
    t = page.evaluate("() => window.__t")
    pressed = t["key"][-1]
    after = [x for x in t[EVENT[which]] if x > pressed]
    if not after:
        raise RuntimeError(f"{which}: no new pixels after the key press")
    return after[0] - pressed


def browser_latency(presses: int) -> dict[str, list[float]]:
    from playwright.sync_api import sync_playwright

    times: dict[str, list[float]] = {"canvas": [], "ipympl": [], "blit": []}
    with tempfile.TemporaryDirectory() as tmp:
        home, root = Path(tmp) / "home", Path(tmp) / "root"
        home.mkdir(), root.mkdir()
        write_notebook(root / "latency.ipynb")
        port, token = tb._free_port(), secrets.token_hex(16)
        env = tb._isolated_env(home)
        env["PYTHONPATH"] = str(ROOT)
        cmd = [sys.executable, "-m", "jupyterlab", "--allow-root", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--ServerApp.token={token}",
               f"--ServerApp.root_dir={root}", "--ServerApp.terminals_enabled=False", "--LabApp.news_url=None",
               "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate",
               "--LabApp.expose_app_in_browser=True"]
        with open(home / "jupyterlab.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            lab = tb.Lab(f"http://127.0.0.1:{port}/", token, root)
            try:
                tb._wait_until_it_answers(lab, proc, home / "jupyterlab.log")
                with sync_playwright() as p:
                    browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                                args=tb.CHROMIUM_ARGS)
                    context = browser.new_context(viewport={"width": 1400, "height": 1000})
                    context.set_default_timeout(tb.PAGE_LOAD_MS)
                    context.add_init_script(INIT)
                    page = context.new_page()
                    tb.open_and_run_all(page, lab, "latency.ipynb", Path(tmp), "latency")
                    page.wait_for_function(  # both ipympl figures shown and sized (a 0 x 0 canvas takes draws too)
                        "() => { const c = [...document.querySelectorAll('.jupyter-matplotlib-canvas-div canvas')];"
                        " return c.length === 4 && c.every(e => e.width > 0 && e.height > 0); }", timeout=60_000)
                    for which in times:  # one unmeasured press each: first-visit caches, JIT
                        press_and_time(page, which, "ArrowRight")
                    for i in range(presses):
                        key = "ArrowLeft" if i % 2 == 0 else "ArrowRight"  # toggles between two values
                        order = list(times)[i % 3:] + list(times)[:i % 3]  # rotated every press
                        for which in order:
                            times[which].append(press_and_time(page, which, key))
                    page.screenshot(path=str(Path(tmp) / "latency.png"))
                    browser.close()
            finally:
                tb._stop(lab, proc)
    return times


def kernel_side(rounds: int) -> dict[str, list[float]]:
    """Seconds per frame in this process: BlitCanvas.png() against a full Agg draw and a PNG of it."""
    import io

    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from gradnorm.teach.widgets import token_imbalance_explorer

    canvas_ex, full_ex = token_imbalance_explorer(), token_imbalance_explorer()
    agg = FigureCanvasAgg(full_ex.figure)
    for artist in full_ex.canvas.dynamic:  # an ipympl figure draws everything every frame
        artist.set_animated(False)
    from PIL import Image

    from gradnorm.teach.canvas import encode_png

    times: dict[str, list[float]] = {"canvas": [], "full draw + PNG": [], "PNG of a frame: encode_png": [],
                                     "PNG of a frame: Pillow": [], "PNG of a frame: Pillow, compress_level=1": []}
    for r in range(rounds):
        value = (4, 6)[r % 2]
        full_ex._holding = canvas_ex._holding = True  # time the render alone, not the observer
        canvas_ex.controls["imbalance"].value = full_ex.controls["imbalance"].value = value
        canvas_ex._draw(**canvas_ex.values), full_ex._draw(**full_ex.values)
        start = time.perf_counter()
        canvas_ex.canvas.png()
        times["canvas"].append(time.perf_counter() - start)
        start = time.perf_counter()
        agg.draw()
        agg.print_png(io.BytesIO())
        times["full draw + PNG"].append(time.perf_counter() - start)
        rgba = np.asarray(agg.buffer_rgba())
        for name, encode in (("encode_png", encode_png),
                             ("Pillow", lambda a: Image.fromarray(a).save(io.BytesIO(), format="png")),
                             ("Pillow, compress_level=1",
                              lambda a: Image.fromarray(a).save(io.BytesIO(), format="png", compress_level=1))):
            start = time.perf_counter()
            encode(rgba)
            times[f"PNG of a frame: {name}"].append(time.perf_counter() - start)
    return times


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--presses", type=int, default=20, help="timed presses per figure")
    cli.add_argument("--out", type=Path, default=None, help="write canvas_latency.md here")
    args = cli.parse_args()
    import ipympl
    import matplotlib

    load_before = os.getloadavg()[0]
    browser = browser_latency(args.presses)
    load_mid = os.getloadavg()[0]
    kernel = kernel_side(2 * args.presses)
    load_after = os.getloadavg()[0]

    def row(name, ms):
        return (f"| {name} | {statistics.median(ms):.0f} | {min(ms):.0f} | {max(ms):.0f} | "
                f"{sum(m <= 100 for m in ms)} of {len(ms)} |")

    lines = [
        "# Key press to redrawn pixels: the in-place canvas against ipympl",
        "",
        f"Generated by `python benchmarks/canvas_latency.py --presses {args.presses} --out benchmarks` (ipympl "
        f"{ipympl.__version__}, matplotlib {matplotlib.__version__}, headless Chromium, {os.cpu_count()} CPUs, "
        f"load average {load_before:.1f} before, {load_mid:.1f} after the browser, {load_after:.1f} at the end).",
        "",
        "Notebook 01's token-imbalance figure (13 x 3.8 in at 80 dpi), its imbalance slider toggled by the "
        "arrow keys; milliseconds from the keydown to the new pixels in the page:",
        "",
        "| figure | median ms | min ms | max ms | presses within 100 ms |",
        "|---|---|---|---|---|",
        row("canvas (BlitCanvas + ipywidgets Image)", browser["canvas"]),
        row("ipympl (draw_idle)", browser["ipympl"]),
        row("ipympl with matplotlib's blitting (restore_region, draw_artist, blit)", browser["blit"]),
        "",
        "The kernel's share alone (this process, the same figure, milliseconds per frame), and the PNG encoder alone:",
        "",
        "| render | median ms | min ms | max ms | frames within 100 ms |",
        "|---|---|---|---|---|",
        *(row(name, [1e3 * s for s in t]) for name, t in kernel.items()),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        (args.out / "canvas_latency.md").write_text(text)


if __name__ == "__main__":
    main()
