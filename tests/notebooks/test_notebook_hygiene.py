"""The notebooks are committed clean and follow the house rules; nbmake runs them separately.

- no outputs, execution counts or saved widget state (a reader's first run starts from nothing,
  and diffs stay readable);
- each opens with what the reader will learn and closes with a summary;
- the first code cell is tagged ``parameters`` and reads ``CI`` to shrink the work in CI;
- every code cell follows narrative markdown, and defines no function or class: the library
  computes, the notebook tells;
- a notebook that uses torch limits it to one thread; every figure it embeds exists.
"""

import ast
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
IDS = [p.name for p in NOTEBOOKS]


def load(path):
    return nbformat.read(path, as_version=4)


def python_source(cell):
    """A code cell's source with IPython magics and shell escapes blanked, parseable by ast."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines())


def test_the_notebooks_are_numbered_in_reading_order():
    names = [p.stem for p in NOTEBOOKS]
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+", n) for n in names), names
    numbers = [int(n[:2]) for n in names]
    assert numbers == sorted(set(numbers))
    assert {"01_token_imbalance", "02_real_gradients", "04_denominators_and_length_bias"} <= set(names)


def saved_state(nb) -> list[str]:
    """What a run left in the notebook: outputs, execution counts, widget state, timings."""
    problems = ["saved widget state (metadata.widgets)"] if "widgets" in nb.metadata else []
    for k, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and cell.outputs:
            problems.append(f"cell {k} has outputs")
        if cell.cell_type == "code" and cell.execution_count is not None:
            problems.append(f"cell {k} has an execution count")
        if "execution" in cell.metadata:
            problems.append(f"cell {k} has execution timing metadata")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_without_outputs_or_widget_state(path):
    nb = load(path)
    nbformat.validate(nb)
    assert saved_state(nb) == [], "clear it: jupyter nbconvert --clear-output --inplace, and drop metadata.widgets"


def test_the_check_catches_a_notebook_that_was_run():
    # The control: the same notebook as a run leaves it must fail the check above.
    nb = load(NOTEBOOKS[0])
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.execution_count = 1
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hello\n")]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    assert len(saved_state(nb)) == 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_opens_with_what_you_will_learn_and_closes_with_a_summary(path):
    cells = load(path).cells
    assert cells[0].cell_type == "markdown" and cells[0].source.startswith("# ")
    assert "what you will learn" in cells[0].source.lower()
    assert cells[-1].cell_type == "markdown" and cells[-1].source.startswith("## Summary")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_first_code_cell_is_a_parameters_cell_that_reads_ci(path):
    code = [c for c in load(path).cells if c.cell_type == "code"]
    first = code[0]
    assert "parameters" in first.metadata.get("tags", [])
    assert 'os.environ.get("CI")' in first.source
    assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_narrative_before_every_code_cell_and_no_math_defined_here(path):
    cells = load(path).cells
    for k, cell in enumerate(cells):
        if cell.cell_type != "code":
            continue
        assert k > 0 and cells[k - 1].cell_type == "markdown", f"cell {k}: code without narrative before it"
        tree = ast.parse(python_source(cell))
        defined = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                                ast.Lambda))]
        assert not defined, f"cell {k} defines code; put it in gradnorm and import it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_torch_runs_on_one_thread_and_imports_come_from_gradnorm(path):
    source = "\n".join(python_source(c) for c in load(path).cells if c.cell_type == "code")
    if re.search(r"^\s*import torch\b", source, re.M):
        assert "torch.set_num_threads(1)" in source
    assert re.search(r"^from gradnorm\b", source, re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_embedded_figures_exist(path):
    text = "\n".join(c.source for c in load(path).cells if c.cell_type == "markdown")
    for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (path.parent / target).resolve().is_file(), f"{target} is missing: run python figures/make_figures.py"


def markdown(path) -> str:
    return "\n".join(c.source for c in load(path).cells if c.cell_type == "markdown")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_nothing_shown_lives_outside_the_notebooks_folder(path):
    # A reader who opens notebooks/ alone (a download, nbviewer) must see every image it shows.
    for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown(path)):
        assert not target.startswith(("../", "/")), f"{target}: point inside notebooks/ or draw it in a cell"


@pytest.mark.parametrize("path", NOTEBOOKS[1:], ids=IDS[1:])
def test_every_later_notebook_points_to_the_glossary(path):
    assert "01's glossary" in load(path).cells[0].source


def glossary_terms_unused(glossary: str, rest: str) -> list[str]:
    """The glossary's symbols that the text after it never uses: a reader meets them before their use."""
    rows = re.findall(r"^\| ([^|]+?) \|", glossary, re.M)
    symbols = [s.strip() for row in rows[1:] for s in re.split(r",(?![^\[]*\])", row)]  # rows[0]: the header
    return [s for s in symbols if s.replace("\\", "") not in rest.replace("\\", "")]


def test_the_glossary_defines_what_01_uses_and_nothing_before_its_use():
    cells = load(NOTEBOOKS[0]).cells
    glossary, rest = cells[1].source, "\n".join(c.source for c in cells[2:])
    for term in ("| W |", "| A |", "| N |", "| w[i, t] |", "| mode |", "| imbalance |"):
        assert term in glossary, term
    assert glossary_terms_unused(glossary, rest) == []
    # the control: a symbol 01 never uses (the group count of 02) would be flagged
    assert glossary_terms_unused(glossary + "\n| N_groups | groups with a token |", rest) == ["N_groups"]


def test_02_defines_the_symbols_of_its_modes_where_it_names_them():
    table = next(c.source for c in load(NOTEBOOKS[1]).cells if c.source.startswith("## 2. Five modes"))
    for term in ("S =", "N_g =", "N_groups =", "C = S · max_new_tokens", "G ="):
        assert term in table, term


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_the_advantage_is_never_called_a(path):
    # A is the accumulation steps everywhere; the advantage is adv_i.
    assert not re.search(r"\bA_i\b|\bA [<>] 0|[+−-]A\b(?! ?=)|\\hat ?A", markdown(path)), path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_explorer_leaves_stills_for_a_reader_without_a_kernel(path):
    cells = load(path).cells
    for k, cell in enumerate(cells):
        lines = [line for line in cell.source.strip().splitlines() if line.strip()] if cell.cell_type == "code" else []
        if lines and re.fullmatch(r"explorer", lines[-1].strip()):  # the cell displays a widget
            later = [c.source for c in cells[k + 1:k + 3] if c.cell_type == "code"]
            assert later and "display(Image(" in later[0] and "print(" in later[0], f"cell {k}: no stills after it"
