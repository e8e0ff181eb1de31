"""An export replaces only what an export wrote; everything else is refused before a byte is written.

The export (``python -m gradnorm.export``, and the trainer's ``--export-hf`` at the end of a run)
replaces its target directory whole. It used to ``rmtree`` whatever was there: ``--out ''`` (an
unset shell variable; ``Path('')`` is ``.``) emptied the working directory, ``--out RUN`` replaced
the run with its export and exited 0, and ``--export-hf`` equal to ``--output-dir`` trained, then
deleted the run's metrics and checkpoints. The rule now (gradnorm.trainer.guards.outpaths): a directory may be
replaced only if it holds the ``.gradnorm-export`` marker an export writes into every directory it
creates; a run's own ``final/`` is the one place inside a run an export may go.

Checked here:

- one table, ``CASES``: a target path, what exists there and around it, allowed or refused. Each
  case runs the real write (``export.write_pretrained`` of a tiny Llama) in a directory of its own;
  a refusal must be one line that says why, with every path under the case directory exactly as it
  was (nothing deleted, nothing half-written); an allowed case must leave every file outside the
  target as it was;
- the command, end to end: ``--out ''`` and ``--out .`` as real ``python -m gradnorm.export`` runs in
  a working directory full of files (exit 2, one ``error:`` line, every file kept); ``--out RUN``
  and ``--out RUN/ckpt_step1`` refused with the run intact; a re-export into the export's own
  earlier output, and into ``RUN/final``, allowed; bad flags one ``error:`` line with exit 2;
- the trainer: a bad ``--export-hf`` (empty, ``.``, the ``--output-dir``, a checkpoint of the
  resumed run, a directory that contains the run, someone's own ``final/``) refused in the
  preflight, exit 2, before any model is built, and once as a real ``python gradnorm/train.py``;
  the control: the default ``final/`` and a re-export over it pass the same preflight;
- ``--overwrite`` sets the old run's exported ``final/`` aside with the rest of it (and leaves a
  user's unmarked ``final/`` alone).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import tiny_models  # examples/tiny_models.py (tests/conftest.py puts it on the path)  # noqa: E402
from tests.helpers.fakes import fake_checkpoint, fake_model  # noqa: E402
from tests.helpers.trainer import one_error_line  # noqa: E402

from gradnorm import export  # noqa: E402
from gradnorm.dist import state as dist_state  # noqa: E402
from gradnorm.train import main as train_main  # noqa: E402
from gradnorm.trainer.checkpoint import store  # noqa: E402
from gradnorm.trainer.config import parse_config  # noqa: E402
from gradnorm.trainer.guards import launch, preflight
from gradnorm.trainer.ownership.lock import PREVIOUS, RunDir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = str(ROOT / "examples" / "arithmetic.jsonl")
MARKER = ".gradnorm-export"  # written out here, not imported: the tests also run against the code before it


def tree(directory: Path) -> dict:
    """Every path under ``directory`` with its content: a file's bytes, a symlink's target, a
    directory as such. Symlinks are not followed, so a link into a case is compared as a link."""
    found = {}
    for parent, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(parent) / name
            key = str(path.relative_to(directory))
            if path.is_symlink():
                found[key] = ("link", os.readlink(path))
            elif path.is_dir():
                found[key] = ("dir",)
            else:
                found[key] = ("file", path.read_bytes())
    return found


@pytest.fixture(scope="module")
def write():
    """write(path): ``export.write_pretrained`` of a tiny random Llama, the export's one write."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    weights = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    tokenizer = tiny_models.build_tiny_tokenizer()
    return lambda path: export.write_pretrained(config, dict(weights), tokenizer, path)


# ------------------------------------------------------------------ the table


def a_run(case: Path, name: str = "run") -> None:
    """A run directory as the trainer leaves it: config.json, metrics.jsonl, a checkpoint."""
    run = case / name
    run.mkdir(parents=True)
    (run / "config.json").write_text('{"model": "some/model"}')
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    fake_checkpoint(run, "ckpt_step1")


def files(*names: str):
    def setup(case: Path, write) -> None:
        for name in names:
            (case / name).parent.mkdir(parents=True, exist_ok=True)
            (case / name).write_text(f"the user's {name}")
    return setup


def link(name: str, target: str, then=None):
    def setup(case: Path, write) -> None:
        if then:
            then(case, write)
        (case / name).symlink_to(target)
    return setup


def exported(name: str, then=None):
    """An earlier export at ``name`` (by the export itself, so marked as the export marks them)."""
    def setup(case: Path, write) -> None:
        write(case / name)
        if then:
            then(case, write)
    return setup


def run_with(then=None):
    def setup(case: Path, write) -> None:
        a_run(case)
        if then:
            then(case, write)
    return setup


ALLOWED = None
CASES = {  # name: (the path given, setup(case, write), None if allowed else what the refusal says, cwd)
    # ---- what an unset variable or a typo names: the working directory and above
    "empty-string": ("", files("notes.txt", "src/main.py"), "is empty", "."),
    "blank": ("  ", files("notes.txt"), "is empty", "."),
    "dot": (".", files("notes.txt", "src/main.py"), "is the current directory", "."),
    "dot-slash": ("./", files("notes.txt"), "is the current directory", "."),
    "cwd-absolute": ("{case}", files("notes.txt"), "is the current directory", "."),
    "parent-of-cwd": ("..", files("notes.txt", "work/draft.txt"), "a parent of the current directory", "work"),
    "grandparent-of-cwd": ("../..", files("notes.txt", "work/deeper/draft.txt"), "a parent of the current directory",
                           "work/deeper"),
    # ---- a run, inside a run, around a run
    "run": ("run", run_with(), "holds a run (ckpt_step1, metrics.jsonl)", "."),
    "run-checkpoint": ("run/ckpt_step1", run_with(), "is inside the run directory", "."),
    "run-new-subdirectory": ("run/hf", run_with(), "is inside the run directory", "."),
    "run-metrics": ("run/metrics.jsonl", run_with(), "is inside the run directory", "."),
    "run-final-new": ("run/final", run_with(), ALLOWED, "."),
    "run-final-re-export": ("run/final", run_with(exported("run/final")), ALLOWED, "."),
    "run-final-foreign": ("run/final", run_with(files("run/final/notes.txt")), "no export wrote (notes.txt", "."),
    "contains-a-run": ("runs", lambda case, write: a_run(case, "runs/grpo"), "no export wrote (grpo", "."),
    "export-that-now-holds-a-run": ("hf", exported("hf", lambda case, write: a_run(case, "hf/run")),
                                    "holds directories an export never writes (run)", "."),
    # ---- symlinks: followed to a directory that is checked like any other, refused otherwise
    "symlink-to-run": ("link", link("link", "run", run_with()), "holds a run", "."),
    "symlink-to-cwd": ("link", link("link", "."), "is the current directory", "."),
    "symlink-dangling": ("link", link("link", "nowhere"), "is a symlink to", "."),
    "symlink-to-file": ("link", link("link", "notes.txt", files("notes.txt")), "is a symlink to", "."),
    "symlink-to-own-export": ("link", link("link", "hf", exported("hf")), ALLOWED, "."),
    # ---- files and other people's directories
    "file": ("notes.txt", files("notes.txt"), "is a file, not a directory", "."),
    "under-a-file": ("notes.txt/hf", files("notes.txt"), "cannot be created: {case}/notes.txt is a file", "."),
    "foreign-directory": ("docs", files("docs/a.md", "docs/b.md"), "no export wrote (a.md, b.md", "."),
    "model-or-old-export-without-marker": ("old", files("old/config.json", "old/model.safetensors"),
                                           f"no export wrote (config.json, model.safetensors; no {MARKER})", "."),
    "inside-own-export": ("hf/sub", exported("hf"), "is inside the export", "."),
    "foreign-temporary-sibling": ("hf", files(".hf.tmp/keep.txt"), "its temporary sibling is a directory of files", "."),
    # ---- allowed: new, empty, an earlier export
    "empty-directory": ("empty", lambda case, write: (case / "empty").mkdir(), ALLOWED, "."),
    "new-nested": ("new/deeper/hf", files("notes.txt"), ALLOWED, "."),
    "re-export": ("hf", exported("hf"), ALLOWED, "."),
    "re-export-after-a-killed-one": ("hf", exported("hf", exported(".hf.tmp")), ALLOWED, "."),
}


@pytest.mark.parametrize("name", CASES)
def test_an_export_replaces_only_what_an_export_wrote(name, write, tmp_path, monkeypatch):
    given, setup, says, cwd = CASES[name]
    case = tmp_path / "case"
    case.mkdir()
    (case / "mine.txt").write_text("beside every case: must never go")
    setup(case, write)
    monkeypatch.chdir(case / cwd)
    before = tree(tmp_path)
    path = given.format(case=case)
    if says is None:
        out = Path(write(path)).resolve()
        assert out == (case / cwd / path).resolve()
        assert (out / "config.json").is_file() and (out / "model.safetensors").is_file() and (out / MARKER).is_file()
        replaced = (out, out.parent / f".{out.name}.tmp")  # the target, and a killed export's leftover

        def inside(key: str) -> bool:  # a symlink is where it lies, not where it points
            path = tmp_path / key
            return any((path.parent.resolve() / path.name).is_relative_to(p) for p in replaced)

        after = tree(tmp_path)
        outside = {key: value for key, value in before.items() if not inside(key)}
        assert {key: after.get(key) for key in outside} == outside  # every file outside the target kept
        new = [key for key in after if key not in before and not inside(key)]
        assert all(out.is_relative_to(tmp_path / key) for key in new), new  # the target's parents, no leftovers
    else:
        with pytest.raises(ValueError) as refused:
            write(path)
        message = str(refused.value)
        assert "\n" not in message and says.format(case=case) in message, message
        assert tree(tmp_path) == before  # nothing deleted, created or half-written


# ------------------------------------------------------------------ the command, end to end


@pytest.fixture(scope="module")
def exportable(tmp_path_factory) -> Path:
    """A Hugging Face run the export can convert: a tiny Llama's config.json and one real checkpoint."""
    transformers = pytest.importorskip("transformers")
    base = tmp_path_factory.mktemp("exportable")
    model_dir = tiny_models.build_tiny_llama(base / "model", seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    run = base / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": str(model_dir)}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    state = dist_state.training_state(model, torch.optim.AdamW(model.parameters()))
    store.save(run, 1, state, {"step": 1}, rank=0)
    return run


def copy_of(run: Path, where: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, where / "run", symlinks=True))


def command_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.mark.launch
@pytest.mark.parametrize("out, says", [("", "--out is empty"), (".", "--out . is the current directory")])
def test_the_command_refuses_the_working_directory_and_keeps_every_file(out, says, exportable, tmp_path):
    work, run = tmp_path / "work", copy_of(exportable, tmp_path)
    for name in ("notes.txt", "src/main.py", ".git/HEAD"):  # a checkout, in small
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(name)
    before = tree(tmp_path)
    assert work.resolve().is_relative_to(tmp_path.resolve())  # the command runs there, and nowhere else
    proc = subprocess.run([sys.executable, "-m", "gradnorm.export", str(run), "--out", out], cwd=work,
                          env=command_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    one_error_line(proc.stderr, says, alone=True)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("out, says", [
    ("{run}", "is the run directory"),
    ("{run}/ckpt_step1", "is inside the run directory"),
    ("{run}/hf", "is inside the run directory"),
    ("{work}", "a directory that contains the run directory"),
])
def test_the_command_refuses_the_run_and_anything_in_it_but_final(out, says, exportable, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    run = copy_of(exportable, work)
    before = tree(tmp_path)
    assert export.main([str(run), "--out", out.format(run=run, work=work)]) == 2
    captured = capsys.readouterr()
    one_error_line(captured.err, says, alone=True)
    assert captured.out == "" and tree(tmp_path) == before


def test_a_re_export_replaces_its_own_earlier_output(exportable, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = copy_of(exportable, tmp_path)
    for out in (tmp_path / "exports" / "hf", run / "final"):
        for _ in range(2):  # the second replaces the first
            assert export.main([str(run), "--out", str(out)]) == 0, capsys.readouterr().err
            assert (out / MARKER).is_file() and (out / "model.safetensors").is_file()
            assert not (out.parent / f".{out.name}.tmp").exists()
    assert (run / "ckpt_step1").is_dir() and (run / "metrics.jsonl").is_file()


@pytest.mark.parametrize("argv, says", [
    ([], "the following arguments are required: run_dir, --out"),
    (["{run}"], "the following arguments are required: --out"),
    (["{run}", "--out", "{tmp}/hf", "--step", "abc"], "argument --step: invalid int value: 'abc'"),
    (["{run}", "--out", "{tmp}/hf", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_the_commands_bad_flags_are_one_error_line_and_exit_2(argv, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        export.main([arg.format(run=tmp_path / "run", tmp=tmp_path) for arg in argv])
    assert stop.value.code == 2
    one_error_line(capsys.readouterr().err, says, alone=True)


def test_an_export_refused_for_bad_input_exits_2(tmp_path, capsys):
    (tmp_path / "run").mkdir()  # no config.json: not a run
    assert export.main([str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    one_error_line(capsys.readouterr().err, "cannot read the run's config.json", alone=True)
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------ the trainer's --export-hf


def trainer_argv(case: Path, flags: list[str], output_dir: str = "{case}/run") -> list[str]:
    argv = ["--model", "{case}/model", "--prompts", PROMPTS, "--prompts-per-step", "2", "--group-size", "2",
            "--eval-prompts", "2", "--no-plot", "--output-dir", output_dir, *flags]
    return [arg.format(case=case) for arg in argv]


TRAINER_CASES = {  # name: (flags, what the error says, setup(case), --output-dir)
    "empty": (["--export-hf", ""], "--export-hf is empty", None, "{case}/run"),
    "dot": (["--export-hf", "."], "--export-hf . is the current directory", None, "{case}/run"),
    "the-output-dir": (["--export-hf", "{case}/run"], "is the run directory", None, "{case}/run"),
    "the-output-dir-resumed": (["--resume", "--export-hf", "{case}/run"], "is the run directory", a_run, "{case}/run"),
    "a-checkpoint-resumed": (["--resume", "--export-hf", "{case}/run/ckpt_step1"], "is inside the run directory",
                             a_run, "{case}/run"),
    "contains-the-output-dir": (["--export-hf", "{case}/runs"], "contains the run directory", None, "{case}/runs/grpo"),
    "someone-elses-final-resumed": (["--resume"], "--export-hf {case}/run/final is a directory of files no export",
                                    lambda case: (a_run(case), files("run/final/notes.txt")(case, None)), "{case}/run"),
}


@pytest.mark.parametrize("name", TRAINER_CASES)
def test_a_bad_export_hf_is_refused_before_training(name, tmp_path, monkeypatch, capsys):
    flags, says, setup, output_dir = TRAINER_CASES[name]
    case = tmp_path / "case"
    fake_model(case / "model")  # enough for the preflight; loading it would fail, so a run that got further fails
    (case / "notes.txt").write_text("the user's")
    if setup:
        setup(case)
    monkeypatch.chdir(case)
    for variable in launch.TORCHRUN_VARS:
        monkeypatch.delenv(variable, raising=False)
    before = tree(tmp_path)
    try:
        code = train_main(trainer_argv(case, flags, output_dir))
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    assert code == 2, captured.err
    one_error_line(captured.err, says.format(case=case), alone=True)
    assert captured.out == "" and tree(tmp_path) == before


def test_an_export_hf_whose_parent_takes_no_files_is_refused_before_training(tmp_path, monkeypatch, capsys):
    # A read-only filesystem refuses even root, whom chmod does not stop; so the refusal is simulated at
    # the one call that probes it. Before, such a target passed the preflight and the export failed
    # after the whole run had trained (exit 1).
    import errno
    import tempfile

    case = tmp_path / "case"
    fake_model(case / "model")
    readonly = case / "readonly"
    readonly.mkdir()
    mkstemp = tempfile.mkstemp

    def refuse(*args, dir=None, **kwargs):
        if Path(dir) == readonly:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    monkeypatch.chdir(case)
    for variable in launch.TORCHRUN_VARS:
        monkeypatch.delenv(variable, raising=False)
    before = tree(tmp_path)
    code = train_main(trainer_argv(case, ["--export-hf", "{case}/readonly/hf"], "{case}/run"))
    assert code == 2
    one_error_line(capsys.readouterr().err, f"--export-hf {case}/readonly/hf: its parent is not writable: "
                                            "Read-only file system", alone=True)
    assert tree(tmp_path) == before
    # the control: the same target on a filesystem that takes files passes the preflight (the fake model
    # then fails to load, exit 1: it got past every check)
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    assert train_main(trainer_argv(case, ["--export-hf", "{case}/readonly/hf"], "{case}/run")) != 2


@pytest.mark.launch
def test_the_trainer_refuses_an_empty_export_hf_as_a_command(tmp_path):
    work = tmp_path / "work"
    fake_model(work / "model")
    (work / "notes.txt").write_text("the user's")
    before = tree(tmp_path)
    env = {k: v for k, v in command_env().items() if k not in launch.TORCHRUN_VARS}
    proc = subprocess.run([sys.executable, str(ROOT / "gradnorm" / "train.py"),
                           *trainer_argv(work, ["--export-hf", ""], output_dir="run")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc.stderr, "--export-hf is empty", alone=True)
    assert tree(tmp_path) == before


def test_control_the_default_final_and_a_re_export_over_it_pass_the_preflight(write, tmp_path, monkeypatch):
    """The refusals above are not blanket: the default --export-hf auto (output-dir/final) passes on a
    fresh run and on a resumed one whose final/ an export wrote; so does a directory of its own."""
    fake_model(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    preflight.check_inputs(parse_config(trainer_argv(tmp_path, [])))
    a_run(tmp_path)
    write(tmp_path / "run" / "final")
    preflight.check_inputs(parse_config(trainer_argv(tmp_path, ["--resume"])))
    preflight.check_inputs(parse_config(trainer_argv(tmp_path, ["--resume", "--export-hf", f"{tmp_path}/hf"])))


# ------------------------------------------------------------------ --overwrite and final/


def test_overwrite_sets_the_old_runs_export_aside_and_leaves_a_users_final_alone(write, tmp_path):
    out = tmp_path / "run"
    a_run(tmp_path)
    write(out / "final")
    exported_before = tree(out / "final")
    run_dir = RunDir(out)
    run_dir.open(resume=False, overwrite=True)
    assert not (out / "final").exists()  # the new run's export is its own, never the old policy
    assert tree(out / PREVIOUS / "final") == exported_before
    run_dir.close(succeeded=False)  # stopped before its first checkpoint: the old run comes back whole
    assert tree(out / "final") == exported_before and not (out / PREVIOUS).exists()

    user = tmp_path / "user"
    a_run(tmp_path, "user")
    files("user/final/notes.txt")(tmp_path, None)
    run_dir = RunDir(user)
    run_dir.open(resume=False, overwrite=True)
    assert (user / "final" / "notes.txt").is_file()  # not an export: not the run's to move
    run_dir.close(succeeded=False)
