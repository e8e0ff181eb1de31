"""``python -m tests.helpers.twins`` finds the runs of a session that trained the same thing from
scratch (the candidates for the table of shared launches), and only those."""

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers.trainer import one_error_line, run_main
from tests.helpers.twins import main, runs_under, trainer_defaults, twins


def fake_run(directory, steps=3, logged=3, starts=(0,), **flags) -> None:
    """A run directory as the trainer leaves it: config.json (the defaults, ``flags``, one history
    entry per start at the given steps) and a metrics.jsonl of ``logged`` lines."""
    directory.mkdir(parents=True)
    config = {**trainer_defaults(), "steps": steps, "output_dir": str(directory), "world_size": 2, **flags,
              "history": [{"started": "2026-12-04T00:00:00+0000", "step": step, "world_size": 2} for step in starts]}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "metrics.jsonl").write_text("".join(json.dumps({"step": n}) + "\n" for n in range(1, logged + 1)))


@pytest.fixture
def runs_dir():
    """A directory outside the session's basetemp, removed after the test: the runs made here are not
    the session's, so the report on the session does not list them as its twins."""
    with tempfile.TemporaryDirectory(prefix="twins-") as directory:
        yield Path(directory).resolve()


def names(found, basetemp) -> list[list[str]]:
    return [[str(run.directory.relative_to(basetemp)) for run in group] for group in found]


def test_twins_are_uninterrupted_runs_of_the_same_flags_and_nothing_else(runs_dir):
    fake_run(runs_dir / "test_a0" / "reference")
    fake_run(runs_dir / "test_b0" / "twin", overwrite=True)  # how it started: the same training
    fake_run(runs_dir / "test_c0" / "other-seed", seed=4)
    fake_run(runs_dir / "test_d0" / "resumed", starts=(0, 2))  # its first half is not the full run
    fake_run(runs_dir / "test_e0" / "killed", logged=2)  # died before its last step
    fake_run(runs_dir / "test_e1" / "torn", logged=2)  # killed while writing its last line
    with open(runs_dir / "test_e1" / "torn" / "metrics.jsonl", "a") as log:
        log.write('{"step": 3, "lo')
    fake_run(runs_dir / "test_f0" / "one-rank", world_size=1)
    fake_run(runs_dir / "test_g0" / "fewer-steps", steps=2, logged=2)
    fake_run(runs_dir / "test_i0" / "copy", output_dir=str(runs_dir / "test_a0" / "reference"))  # copytree of one
    (runs_dir / "test_h0" / "tiny-llama").mkdir(parents=True)  # a Hugging Face model's config.json is no run
    (runs_dir / "test_h0" / "tiny-llama" / "config.json").write_text('{"model_type": "llama"}')
    runs = runs_under(runs_dir)
    assert len(runs) == 9 and sum(run.uninterrupted for run in runs) == 5
    assert names(twins(runs), runs_dir) == [["test_a0/reference", "test_b0/twin"]]


def test_ignore_leaves_out_flags_the_reader_knows_change_no_step(runs_dir):
    fake_run(runs_dir / "every-4" / "run", save_every=4)
    fake_run(runs_dir / "every-100" / "run")
    assert twins(runs_under(runs_dir)) == []  # the control: strict by default
    assert names(twins(runs_under(runs_dir), ignore=("save_every",)), runs_dir) == [["every-100/run", "every-4/run"]]


def test_the_report_names_each_set_by_its_flags_and_its_directories(runs_dir, capsys):
    fake_run(runs_dir / "test_a0" / "run", seed=3, pack=True, plot=False)
    fake_run(runs_dir / "test_b0" / "run", seed=3, pack=True, plot=False)
    fake_run(runs_dir / "test_c0" / "run")
    assert main([str(runs_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{runs_dir}: 3 run directories, 3 uninterrupted; 1 set of twins:"
    assert out[2] == "2 runs of --pack --steps 3 --seed 3 --no-plot  (world size 2)"
    assert out[3:] == ["    test_a0/run", "    test_b0/run"]


def test_real_runs_of_the_trainer_are_read_as_the_trainer_wrote_them(runs_dir):
    """config.json and metrics.jsonl as gradnorm/train.py writes them, not as this test imagines them:
    of two 2-step runs, a copy of one, a 3-step run and a 2-step one resumed after its first step,
    the first two are the twins."""
    for name, steps in [("first", "2"), ("second", "2"), ("longer", "3"), ("resumed", "1")]:
        assert run_main(runs_dir / name / "run", "--steps", steps) == 0
    assert run_main(runs_dir / "resumed" / "run", "--steps", "2", "--resume") == 0
    shutil.copytree(runs_dir / "first" / "run", runs_dir / "copied" / "run")
    runs = runs_under(runs_dir)
    assert [str(run.directory.relative_to(runs_dir)) for run in runs] == ["copied/run", "first/run", "longer/run",
                                                                           "resumed/run", "second/run"]
    assert [run.uninterrupted for run in runs] == [False, True, True, False, True]
    assert names(twins(runs), runs_dir) == [["first/run", "second/run"]]


@pytest.mark.parametrize("argv, says", [
    (["{tmp}/nowhere"], "is not a directory: give a pytest session's --basetemp"),
    (["{tmp}", "--ignore", "save_every,sede"], "error: --ignore sede: not a field of config.json; its fields are "),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, tmp_path, capsys):
    assert main([arg.format(tmp=tmp_path) for arg in argv]) == 2
    one_error_line(capsys.readouterr().err, says, alone=True)
