"""The notebooks' widgets work for a reader: JupyterLab in a real browser, not only a kernel.

One JupyterLab server for the session (the ``lab`` fixture: tests/helpers/jupyterlab.py, on
127.0.0.1, a free port, a random token, fresh config, runtime, settings and workspace dirs, no
news or update lookups) serves a copy of `notebooks/` with outputs stripped, so running them never
writes into the repo and every output seen comes from this run. For each notebook, Playwright drives Debian's Chromium as a reader would:

1. open the notebook and pick "Run All Cells" from the Run menu;
2. wait until the kernel is idle and every code cell has an execution count;
3. check that no cell shows an error: an error output, a traceback on stderr (also inside widget
   Output areas), a widget that failed to render, or an error in the log console;
4. focus a slider, picked by its description, and press ArrowRight a few times;
5. wait for the last redraw, then check that the plot image in that cell differs (its bytes),
   that the slider's readout shows the new value, and that the kernel-driven text readout is
   the one the library computes for the values the page now shows.

A scratch notebook written here checks the harness itself, with a control that must fail: the
same notebook with its callback disconnected (style rule 9).

Screenshots of each page go to the test's tmp_path (`--basetemp=DIR` keeps them under DIR).

Run:   .venv/bin/python -m pytest tests/notebooks/test_browser.py
Skip:  .venv/bin/python -m pytest -m "not browser"
Without /usr/bin/chromium or playwright these tests skip, except with CI=true, where they fail
(tests/conftest.py); so does a notebook that is missing.
"""

import html
import re
import secrets
from dataclasses import dataclass

import nbformat
import pytest
from tests.helpers.jupyterlab import notebook_path

pytestmark = pytest.mark.browser

CHROMIUM_ARGS = [  # as root, headless, on a machine with no network but loopback
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
# Every wait is bounded. The notebooks are small; these are generous for 2 busy cores.
PAGE_LOAD_MS = 60_000
RUN_ALL_MS = 150_000
REDRAW_MS = 30_000
QUIET_MS = 1_500  # the cell counts as redrawn for the last time once nothing changed for this long
PRESSES = 3
ERROR_TEXT = re.compile(r"Traceback|^\w*(Error|Exception)\b", re.M)  # not warnings, not progress bars


# ---------------------------------------------------------------- browser and page

@pytest.fixture(scope="session")
def browser(chromium_executable):
    from playwright.sync_api import sync_playwright  # imported here, so that a missing package skips

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_executable, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser, lab):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(PAGE_LOAD_MS)
    page = context.new_page()
    try:
        yield page
    finally:
        context.close()
        for session in lab.api("GET", "api/sessions"):  # free the two cores for the next test
            lab.api("DELETE", f"api/sessions/{session['id']}")


# ---------------------------------------------------------------- what a reader does

def open_and_run_all(page, lab, relpath, shots, stem):
    try:
        page.goto(lab.notebook_url(relpath, workspace=re.sub(r"\W", "-", stem)), timeout=PAGE_LOAD_MS)
        page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=PAGE_LOAD_MS)
        page.wait_for_function(_JS_KERNEL_IDLE, timeout=PAGE_LOAD_MS)
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator("#jp-mainmenu-run .lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        page.wait_for_function(_JS_ALL_RUN, timeout=RUN_ALL_MS)
    finally:
        page.screenshot(path=shots / f"{stem}-1-run-all.png")
    assert_no_errors(page)


def assert_no_errors(page):
    in_model = page.evaluate(_JS_ERROR_OUTPUTS)
    assert not in_model, f"cells raised: {in_model}"
    # Widget Output areas are not in the notebook model: read what the page shows.
    shown = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').all_inner_texts()
    tracebacks = [t[-1500:] for t in shown if ERROR_TEXT.search(t)]  # the end says what went wrong
    assert not tracebacks, "the page shows errors:\n" + "\n---\n".join(tracebacks)
    assert page.get_by_text("Error displaying widget").count() == 0, "a widget failed to render"
    missing = page.evaluate(_JS_BROKEN_MARKDOWN_IMAGES)
    assert not missing, f"markdown images that do not load: {missing}"
    # A callback that raises outside an Output area logs to JupyterLab's log console, whose
    # status-bar item then appears: open it as a reader would and look for a traceback.
    log_item = page.locator(".jp-LogConsoleStatusItem:not(.lm-mod-hidden)")
    if log_item.count() and log_item.is_visible():
        if not page.locator(".jp-LogConsolePanel").is_visible():
            log_item.click()
        panel = page.locator(".jp-LogConsolePanel")
        panel.wait_for(timeout=10_000)
        errors = [t[-1500:] for t in panel.locator(".jp-OutputArea-output").all_inner_texts() if ERROR_TEXT.search(t)]
        assert not errors, "the log console shows errors:\n" + "\n---\n".join(errors)


@dataclass
class SliderMove:
    readout_before: str
    readout_after: str
    texts_before: list  # the Label/HTML readouts of the cell
    texts_after: list
    sliders_after: dict  # description -> readout of every slider in the cell


def move_slider_and_check_redraw(page, description, shots, stem, presses=PRESSES, timeout_ms=REDRAW_MS):
    """Press ArrowRight on the slider described `description`; assert the plot in its cell changed."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    slider = page.locator(".widget-slider").filter(
        has=page.locator(".widget-label", has_text=re.compile(rf"^\s*{re.escape(description)}\s*$")))
    assert slider.count() == 1, f"expected one slider described {description!r}, found {slider.count()}"
    cell = page.locator(".jp-CodeCell").filter(has=slider)
    handle, readout = slider.locator(".noUi-handle"), slider.locator(".widget-readout")
    cell.scroll_into_view_if_needed()
    # A cell scrolled into view may draw its widgets a moment later (JupyterLab renders cells near
    # the viewport only): CI once read an empty readout here. Wait for the slider to show a value.
    page.wait_for_function("el => el.textContent.trim() !== ''", arg=readout.element_handle(), timeout=timeout_ms)
    srcs_before, digests_before = _image_srcs(cell), _image_digests(cell)
    assert srcs_before, f"no plot image in the cell of slider {description!r}"
    readout_before, texts_before = readout.inner_text(), _readout_texts(cell)
    page.screenshot(path=shots / f"{stem}-2-before-slider.png")

    handle.focus()  # as if tabbed to; the keys then go to the slider
    for _ in range(presses):
        page.keyboard.press("ArrowRight")
    try:
        # Each press is its own comm message and the kernel goes idle between them: wait for the
        # last redraw, i.e. an idle kernel and a cell that has not changed for QUIET_MS.
        page.wait_for_function(_JS_SETTLED_AND_REDRAWN, polling=100, timeout=timeout_ms,
                               arg={"cell": cell.element_handle(), "before": srcs_before,
                                    "quietMs": QUIET_MS, "key": secrets.token_hex(8)})
    except PlaywrightTimeout as exc:  # say what a reader would have seen
        raise AssertionError(f"the plot of slider {description!r} did not change within {timeout_ms} ms "
                             f"after {presses} x ArrowRight (slider readout {readout_before!r} -> "
                             f"{readout.inner_text()!r})") from exc
    finally:
        cell.scroll_into_view_if_needed()
        page.screenshot(path=shots / f"{stem}-3-after-slider.png")
    assert _image_digests(cell) != digests_before, "the image was replaced by the same picture"
    assert_no_errors(page)
    sliders = dict(zip(cell.locator(".widget-slider > .widget-label").all_inner_texts(),
                       cell.locator(".widget-slider .widget-readout").all_inner_texts()))
    move = SliderMove(readout_before, readout.inner_text(), texts_before, _readout_texts(cell), sliders)
    assert move.readout_after != move.readout_before, "the slider's readout did not move"
    assert move.texts_after != move.texts_before, f"the readout did not change: {move.texts_after}"
    return move


def _image_srcs(cell):
    return cell.locator(".jp-OutputArea-output img").evaluate_all("els => els.map(e => e.src)")


def _image_digests(cell):
    """SHA-256 of each image's bytes: an Image widget gets a new blob: URL even for the same picture."""
    return cell.locator(".jp-OutputArea-output img").evaluate_all("""async els => Promise.all(els.map(async e => {
        const digest = await crypto.subtle.digest('SHA-256', await (await fetch(e.src)).arrayBuffer());
        return [...new Uint8Array(digest)].map(b => b.toString(16).padStart(2, '0')).join('');
    }))""")


def _readout_texts(cell):
    """Text of the Label and HTML widgets in a cell: the readouts the kernel writes."""
    # A Label widget is a div.widget-label; a slider's description is a <label class="widget-label">.
    return cell.locator("div.jupyter-widgets.widget-label, .widget-html-content").all_inner_texts()


def as_text(markup):
    """What a browser shows of a readout's HTML, whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", re.sub(r"<br\s*/?>", " ", markup))).split())


_JS_PANEL = "const panel = window.jupyterapp.shell.currentWidget;"
_JS_KERNEL_IDLE = """() => {""" + _JS_PANEL + """
  const kernel = panel && panel.sessionContext && panel.sessionContext.session
                 && panel.sessionContext.session.kernel;
  return !!kernel && kernel.status === 'idle';
}"""
_JS_ALL_RUN = """() => {""" + _JS_PANEL + """
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  if (!kernel || kernel.status !== 'idle') return false;
  const cells = panel.content.model.cells;
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type === 'code' && c.sharedModel.getSource().trim() && c.executionCount === null) return false;
  }
  return ![...panel.node.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].some(p => p.textContent.includes('*'));
}"""
_JS_ERROR_OUTPUTS = """() => {""" + _JS_PANEL + """
  const found = [];
  const cells = panel.content.model.cells;
  for (let i = 0; i < cells.length; i++) {
    const outputs = cells.get(i).outputs;
    for (let j = 0; outputs && j < outputs.length; j++) {
      const o = outputs.get(j).toJSON();
      if (o.output_type === 'error') found.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
    }
  }
  return found;
}"""
_JS_BROKEN_MARKDOWN_IMAGES = """async () => {
  const images = [...document.querySelectorAll('.jp-NotebookPanel .jp-MarkdownOutput img')];
  const settled = Promise.all(images.map(img => img.decode().catch(() => null)));  // loaded or failed
  await Promise.race([settled, new Promise(done => setTimeout(done, 10000))]);
  return images.filter(img => !img.naturalWidth).map(img => img.alt || img.src);
}"""
_JS_SETTLED_AND_REDRAWN = """({cell, before, quietMs, key}) => {""" + _JS_PANEL + """
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const images = [...cell.querySelectorAll('.jp-OutputArea-output img')].map(e => e.src);
  const state = [kernel && kernel.status, images.join(), cell.innerText].join('|');
  const last = cell.__settle;  // what this wait saw at its previous poll, kept on the cell
  if (!last || last.key !== key || last.state !== state) {
    cell.__settle = {key, state, since: Date.now()};
    return false;
  }
  return kernel.status === 'idle' && Date.now() - last.since >= quietMs
         && images.length > 0 && images.join() !== before.join();
}"""


# ---------------------------------------------------------------- the notebooks

@pytest.mark.parametrize("name, description, factory, options", [
    pytest.param("01_token_imbalance.ipynb", "imbalance", "token_imbalance_explorer", "IMBALANCES", id="01"),
    pytest.param("04_denominators_and_length_bias.ipynb", "wrong length", "length_bias_explorer", None, id="04"),
])
def test_notebook_slider_redraws_its_plot(page, lab, tmp_path, name, description, factory, options):
    from gradnorm.teach import widgets

    relpath, stem = notebook_path(name), name[:2]
    open_and_run_all(page, lab, relpath, tmp_path, stem)
    move = move_slider_and_check_redraw(page, description, tmp_path, stem)
    # An IntSlider moves by 1 per press; a SelectionSlider (01's exact imbalances) by one option.
    steps = list(getattr(widgets, options)) if options else None
    before, after = int(move.readout_before), int(move.readout_after)
    assert (steps.index(after) - steps.index(before) if steps else after - before) == PRESSES

    # The text readout is the library's, for the values the sliders now show (the notebooks call
    # the explorers with their defaults; the checkbox of 04 stays at its default).
    explorer = getattr(widgets, factory)()
    names = {control.description: name for name, control in explorer.controls.items()}
    explorer.update(**{names[d]: int(v) for d, v in move.sliders_after.items()})
    assert as_text(explorer.readout.value) in [" ".join(t.split()) for t in move.texts_after]


# ---------------------------------------------------------------- the harness on a scratch notebook

SCRATCH_SETUP = """\
import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import clear_output, display
"""
SCRATCH_WIDGET = """\
slider = widgets.IntSlider(value=2, min=1, max=10, description="frequency")
readout = widgets.Label()
out = widgets.Output()

def draw(change=None):
    k = slider.value
    readout.value = f"frequency = {k}"
    with out:
        clear_output(wait=True)
        fig, ax = plt.subplots(figsize=(5, 2.5))
        x = np.linspace(0, 1, 400)
        ax.plot(x, np.sin(2 * np.pi * k * x))
        ax.set_title(f"sin(2 pi {k} x)")
        plt.show()

draw()
CONNECT
display(widgets.VBox([slider, readout, out]))
"""


def write_scratch(path, connect='slider.observe(draw, names="value")'):
    """A slider, a Label readout and a matplotlib plot in an Output area, as the issue describes."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# Scratch: a slider drives a plot"),
                nbformat.v4.new_code_cell(SCRATCH_SETUP),
                nbformat.v4.new_code_cell(SCRATCH_WIDGET.replace("CONNECT", connect))]
    nbformat.write(nb, path)


def test_harness_sees_a_slider_redraw_its_plot(page, lab, tmp_path):
    write_scratch(lab.root / "scratch_ok.ipynb")
    open_and_run_all(page, lab, "scratch_ok.ipynb", tmp_path, "scratch_ok")
    move = move_slider_and_check_redraw(page, "frequency", tmp_path, "scratch_ok")
    assert (move.readout_before, move.readout_after) == ("2", str(2 + PRESSES))
    assert move.texts_after == [f"frequency = {2 + PRESSES}"], move.texts_after


def test_harness_fails_when_the_callback_is_broken(page, lab, tmp_path):
    # The control: the slider still moves in the page, but nothing redraws the plot.
    write_scratch(lab.root / "scratch_broken.ipynb", connect='slider.observe(lambda change: None, names="value")')
    open_and_run_all(page, lab, "scratch_broken.ipynb", tmp_path, "scratch_broken")
    with pytest.raises(AssertionError, match="did not change"):
        move_slider_and_check_redraw(page, "frequency", tmp_path, "scratch_broken", timeout_ms=5_000)
