"""The figure command: every figure's data checked (never its pixels), and deterministic output.

``figures/make_figures.py`` is a script, not part of the package; it is loaded from its path.
"""

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose

pytest.importorskip("matplotlib")
pytest.importorskip("ipywidgets")

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module")
def make_figures():
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "figures" / "make_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_worked_example_figure(make_figures):
    _, data = make_figures.figure_worked_example()
    assert_allclose(data["shares"]["local"].update, [0.5, 0.5])
    assert_allclose(data["shares"]["token"].update, [17 / 41, 24 / 41])
    assert_allclose(data["layout"]["local"].weight[:2], 1 / 12)


def test_token_imbalance_figure_is_the_explorer_at_its_defaults(make_figures):
    _, data = make_figures.figure_token_imbalance()
    assert data["values"] == {"world_size": 2, "accum_steps": 2, "imbalance": 4}
    assert_allclose(data["shares"]["local"].update, [0.5, 0.5])
    assert_allclose(data["shares"]["local"].tokens, [60 / 156, 96 / 156])


def test_share_vs_imbalance_figure(make_figures):
    _, data = make_figures.figure_share_vs_imbalance()
    sweep = data["sweep"]
    assert_allclose(sweep.update_share["local"], 0.5)  # local ignores the data
    assert_allclose(sweep.update_share["token"], sweep.token_share)
    assert sweep.token_share[0] == pytest.approx(0.5) and np.all(np.diff(sweep.token_share) <= 0)


def test_gradient_error_figure(make_figures):
    _, data = make_figures.figure_gradient_error()
    sweeps = data["sweeps"]
    for sweep in sweeps.values():
        for mode in ("token", "sequence", "group", "constant"):
            assert sweep.relative_error[mode].max() < 1e-12
        assert sweep.relative_error["local"][0] < 1e-12  # imbalance 1: balanced microbatches
    final = {shard: s.relative_error["local"][-1] for shard, s in sweeps.items()}
    assert final["length"] > 0.5  # sorted by length: the worst case
    assert final["length"] > final["contiguous"] > final["balanced"] and final["length"] > final["interleave"]


def test_length_bias_figures(make_figures):
    _, data = make_figures.figure_length_weights()
    view = data["view"]
    w = view.token_weight["sequence"]
    assert w[0] / w[-1] == pytest.approx(64 / 4)  # 1/|o_i|
    assert_allclose(view.group_share("group"), 0.25)
    _, data = make_figures.figure_correct_vs_wrong()
    up, down = data["view"].push_per_token["sequence"]
    assert abs(down) / up == pytest.approx(10 / 40)
    _, data = make_figures.figure_batch_dependence()
    weights = data["view"].token_weight
    assert np.all(np.diff(weights["token"]) < 0) and np.ptp(weights["constant"]) == 0


def test_every_embedded_or_shown_figure_is_made_by_the_command(make_figures):
    docs = [ROOT / "README.md", ROOT / "docs" / "notebooks.md", *sorted((ROOT / "notebooks").glob("*.ipynb"))]
    referenced = {name for doc in docs for name in re.findall(r"figures/([\w.-]+\.png)", doc.read_text())}
    assert referenced <= set(make_figures.FIGURES), referenced - set(make_figures.FIGURES)


def test_output_is_deterministic(make_figures, tmp_path):
    # Two renders of the same figure give the same bytes (no timestamps, fixed inputs).
    for k in range(2):
        fig, _ = make_figures.figure_correct_vs_wrong()
        fig.savefig(tmp_path / f"{k}.png", dpi=make_figures.DPI, metadata={"Software": None})
    assert (tmp_path / "0.png").read_bytes() == (tmp_path / "1.png").read_bytes()
