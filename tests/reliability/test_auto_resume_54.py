"""Issue 54: what ``--auto-resume`` makes of a stranded ``--overwrite``, and whether the lines that it
and a failed run print name a way on that works as typed.

What must hold (gradnorm/trainer/ownership/restart.py, history.py, guards/failures.py):
- an --overwrite SIGKILLed before its first checkpoint (the old run in previous_run/): the same
  flags with --auto-resume start the replacement over and say, in a ``warning:`` line, that the old
  run goes at this run's first checkpoint; any other command (the old run's own requeue, or no
  config.json to tell) is refused in one line naming ``--resume`` and ``--overwrite`` in place of
  ``--auto-resume``, and each, typed as named, gets the run going (the old run continued to the
  metrics of an uninterrupted run, or the replacement started over);
- every refusal of --auto-resume names only ways that work: no ``--resume`` where there is no
  checkpoint to resume from;
- a finished run whose end-of-run export was killed: --auto-resume still exits 0 (a requeue of a
  finished run must not fail), and its line names the export command, which, typed as named,
  writes the export;
- a failed write with no checkpoint (--save-every 0) says that there is nothing to resume and how
  to start over, and that command works; with a checkpoint (the control) it names --resume, which works.
"""

import errno
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers.faults import dead_pid
from tests.helpers.runfiles import comparable, every_file, metrics
from tests.helpers.trainer import TINY, one_error_line, run_main, tiny

from gradnorm import train as train_module
from gradnorm.train import main
from gradnorm.trainer.checkpoint.store import latest_checkpoint
from gradnorm.trainer.ownership import lock

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

OLD = tiny(save_every="1")
"""The run an --overwrite replaces: a checkpoint at every step."""

NEW = tiny(save_every="2", seed="4")
"""The replacement: another run (another seed), whose first checkpoint comes at step 2."""

KILL_IN = """
import os, signal, sys
from gradnorm import train
name, step = sys.argv[1], int(sys.argv[2])
honest = getattr(train, name)
def killed(*args, **kwargs):
    if kwargs.get("step", 0) == step:
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does: no finally runs, nothing is put back
    return honest(*args, **kwargs)
setattr(train, name, killed)
sys.exit(train.main(sys.argv[3:]))
"""


def killed_in(name: str, step: int, out: Path, *flags: str) -> None:
    """A run of ``flags`` SIGKILLed in gradnorm.train's ``name`` (at the call of ``step``; 0: the first)."""
    done = subprocess.run([sys.executable, "-c", KILL_IN, name, str(step), *flags, "--output-dir", str(out)], env=ENV,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr


def ways_out(line: str) -> set[str]:
    """The start flags a refusal names: each one a way out, to be typed in place of --auto-resume."""
    return set(re.findall(r"(?<![\w-])--(?:resume|overwrite)(?![\w-])", line))


def as_typed(line: str, way: str) -> bool:
    """Whether ``line`` says how to type ``way``: beside --auto-resume it is refused ("drop --resume")."""
    return f"{way} in place of --auto-resume" in line


def instead(argv: list[str], flag: str, start: str = "--auto-resume") -> list[str]:
    """``argv`` with its start flag ``start`` replaced by ``flag``: the advice typed as it reads."""
    assert start in argv
    return [flag if a == start else a for a in argv]


@pytest.fixture(scope="module")
def stranded(tmp_path_factory) -> Path:
    """An --overwrite of a 2-step run, SIGKILLed in its step 2, before its first checkpoint: the old run
    (ckpt_step1, ckpt_step2) in previous_run/, the replacement's config.json and step-1 metrics in out."""
    out = tmp_path_factory.mktemp("stranded") / "run"
    assert run_main(out, "--steps", "2", base=OLD) == 0
    killed_in("generate_rollout", 2, out, *NEW, "--steps", "4", "--overwrite")
    assert latest_checkpoint(out) is None and latest_checkpoint(out / lock.PREVIOUS).name == "ckpt_step2"
    assert [m["step"] for m in metrics(out)] == [1]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, Path]:
    """The old run and the replacement, each run to step 4 without a stop: what a way out must reach."""
    base = tmp_path_factory.mktemp("uninterrupted")
    for name, flags in (("old", OLD), ("new", NEW)):
        assert run_main(base / name, "--steps", "4", base=flags) == 0
    return {"old": base / "old", "new": base / "new"}


def copy_of(run: Path, where: Path) -> Path:
    return Path(shutil.copytree(run, where, symlinks=True))


@pytest.mark.launch
def test_auto_resume_of_a_stranded_overwrite_says_the_old_run_goes_at_the_first_checkpoint(stranded, uninterrupted,
                                                                                         tmp_path, capsys):
    """Issue 54, finding: an --overwrite run killed before its first checkpoint (an OOM kill) leaves the
    old run in previous_run/; the same flags with --auto-resume started over and deleted the old run
    at the first checkpoint, printing nothing."""
    out = copy_of(stranded, tmp_path / "run")
    assert run_main(out, "--steps", "4", "--auto-resume", base=NEW) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("warning: --auto-resume:")]
    assert len(said) == 1, err
    assert f"{out / lock.PREVIOUS}/ the run an --overwrite replaced (its latest checkpoint ckpt_step2)" in said[0]
    assert f"the old run in {out / lock.PREVIOUS}/ is deleted at this run's first checkpoint" in said[0]
    assert comparable(out) == comparable(uninterrupted["new"])  # the replacement, started over, ran whole
    assert not (out / lock.PREVIOUS).exists()
    # the control: this run's own leftovers, with no old run set aside, are started over without that line
    for ckpt in out.glob("ckpt_step*"):
        shutil.rmtree(ckpt)
    assert run_main(out, "--steps", "4", "--auto-resume", base=NEW) == 0
    assert "warning: --auto-resume:" not in capsys.readouterr().err


@pytest.mark.launch
def test_an_elastic_restart_killed_twice_before_its_first_checkpoint_goes_on(uninterrupted, tmp_path, capsys):
    """Issue 54, finding: a restart must continue. A start of this run killed in its step 2 leaves its
    files; the restart sets them aside (previous_run/, no checkpoint) and is killed loading its model,
    before it wrote its config.json: the directory is stranded with no config.json of the replacement,
    yet previous_run/ is this run's own, with nothing to resume, so the next restart starts over."""
    work, command = tmp_path / "work", [*NEW, "--steps", "4", "--auto-resume"]
    killed_in("generate_rollout", 2, work, *command)
    killed_in("build_policy", 0, work, *command)
    assert lock.stranded(work) and not (work / "config.json").exists()
    out = copy_of(work, tmp_path / "run")
    assert run_main(out, "--steps", "4", "--auto-resume", base=NEW) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: --auto-resume:")]
    assert said == [f"warning: --auto-resume: {out / lock.PREVIOUS}/ holds this run's files from an earlier start "
                    "that stopped before its first checkpoint; this run starts over, and they are deleted at its first "
                    "checkpoint"], said
    assert comparable(out) == comparable(uninterrupted["new"]) and not (out / lock.PREVIOUS).exists()
    # the control: previous_run/ of another run (another seed) is not this run's to delete: refused
    config = json.loads((work / lock.PREVIOUS / "config.json").read_text())
    (work / lock.PREVIOUS / "config.json").write_text(json.dumps({**config, "seed": 5}))
    assert run_main(work, "--steps", "4", "--auto-resume", base=NEW) == 2
    one_error_line(capsys.readouterr().err, "and left no config.json to tell whether it is this run: rerun this "
                                            "command with --resume in place of --auto-resume")


@pytest.mark.launch
def test_a_live_overwrite_in_its_warm_up_is_in_use_not_stranded(stranded, tmp_path, capsys):
    """An --overwrite still before its first checkpoint looks stranded (previous_run/, no checkpoint)
    but its lock is live: --auto-resume says the directory is in use, with no start-over warning."""
    out = copy_of(stranded, tmp_path / "run")
    (out / lock.LOCK).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "now"}))
    before = every_file(out)
    assert run_main(out, "--steps", "4", "--auto-resume", base=NEW) == 2
    err = capsys.readouterr().err
    one_error_line(err, f"--output-dir {out} is in use by another run (pid {os.getpid()}")
    assert "warning:" not in err and every_file(out) == before
    # the control: once that run is dead (its lock left behind), the same directory is stranded and started over
    (out / lock.LOCK).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname(), "started": "then"}))
    assert run_main(out, "--steps", "4", "--auto-resume", base=NEW) == 0
    assert "warning: --auto-resume:" in capsys.readouterr().err


@pytest.mark.launch
@pytest.mark.parametrize("case", ["the-old-runs-requeue", "no-config-json"])
def test_a_stranded_overwrite_that_is_not_this_run_is_refused_naming_two_ways_that_work(case, stranded, uninterrupted,
                                                                                       tmp_path, capsys):
    """Issue 54, findings: --auto-resume took a stranded --overwrite for this run's own leftovers
    whatever the command; and after a kill stranded an --overwrite, --auto-resume advised --resume,
    which then refused: a dead end. Here the command is the old run's (its requeue): refused in one
    line, nothing touched, and each way it names, typed as named, gets the run going."""
    work = copy_of(stranded, tmp_path / "stranded")
    if case == "no-config-json":  # the replacement was killed before it wrote one: whose it is, nobody can tell
        (work / "config.json").unlink()
    before = every_file(work)
    command = ["--steps", "4", "--auto-resume"]
    assert run_main(work, *command, base=OLD) == 2
    line = one_error_line(capsys.readouterr().err, f"--auto-resume: {work / lock.PREVIOUS}/ holds the run an "
                                                   "--overwrite replaced (its latest checkpoint ckpt_step2)")
    assert every_file(work) == before
    assert ways_out(line) == {"--resume", "--overwrite"}, line
    for way in sorted(ways_out(line), reverse=True):  # --resume first: the dead end of the finding
        out = copy_of(work, tmp_path / way.strip("-"))
        code = run_main(out, *instead(command, way), base=OLD)
        err = capsys.readouterr().err
        assert code == 0, err
        assert not (out / lock.PREVIOUS).exists()
        # --resume puts the old run back and continues it; --overwrite starts a run of these flags afresh
        assert comparable(out) == comparable(uninterrupted["old"]), way
        assert as_typed(line, way), line


@pytest.mark.launch
def test_resume_of_a_stranded_overwrite_with_the_replacements_flags_names_a_way_that_works(stranded, uninterrupted,
                                                                                         tmp_path, capsys):
    """--resume of a stranded --overwrite continues the old run (put back from previous_run/), so the
    replacement's flags are refused as another run's, with a way that works as typed: --overwrite in
    place of --resume (beside it, refused) starts the replacement over."""
    out = copy_of(stranded, tmp_path / "run")
    command = ["--steps", "4", "--resume"]
    assert run_main(out, *command, base=NEW) == 2
    line = one_error_line(capsys.readouterr().err, "--resume: the flags that define the run differ from")
    assert "--seed 3 -> 4;" in line and line.endswith("(another --output-dir, or --overwrite in place of --resume)")
    assert run_main(out, *[a if a != "--resume" else "--overwrite" for a in command], base=NEW) == 0
    assert comparable(out) == comparable(uninterrupted["new"])
    # the control: the old run's own flags resume it, from the checkpoint it had in previous_run/
    out = copy_of(stranded, tmp_path / "old")
    assert run_main(out, *command, base=OLD) == 0
    captured = capsys.readouterr()
    assert f"resumed from {out / 'ckpt_step2'} at step 2" in captured.out + captured.err
    assert comparable(out) == comparable(uninterrupted["old"])


@pytest.mark.parametrize("checkpoint", [True, False], ids=["with-a-checkpoint", "without-one"])
def test_files_without_config_json_name_only_ways_that_work(checkpoint, tmp_path, capsys):
    """Issue 54, finding: every line --auto-resume prints names a way out that works. Files of a run
    without a config.json were told "--resume to continue it anyway" with no checkpoint to resume
    from; with one (the control), --resume is a way, and works."""
    work = tmp_path / "run"
    assert run_main(work, "--steps", "2", base=OLD) == 0
    (work / "config.json").unlink()
    if not checkpoint:
        for ckpt in work.glob("ckpt_step*"):
            shutil.rmtree(ckpt)
    command = ["--steps", "3", "--auto-resume"]
    capsys.readouterr()
    assert run_main(work, *command, base=OLD) == 2
    line = one_error_line(capsys.readouterr().err, "but no config.json to tell whether it is this run")
    assert "--overwrite" in ways_out(line), line
    for way in sorted(ways_out(line), reverse=True):
        out = copy_of(work, tmp_path / way.strip("-"))
        code = run_main(out, *instead(command, way), base=OLD)
        assert code == 0, (line, capsys.readouterr().err)
        assert [m["step"] for m in metrics(out)] == [1, 2, 3]
        assert as_typed(line, way), line
    assert ("--resume" in ways_out(line)) == checkpoint, line  # resuming is a way only from a checkpoint


def test_another_runs_directory_names_overwrite_in_place_of_auto_resume_and_that_works(tmp_path, capsys):
    """Issue 54, finding: every line --auto-resume prints names a way out that works as typed; "or
    --overwrite" beside --auto-resume is refused ("drop --overwrite"), so the line says in place of it."""
    work = tmp_path / "run"
    assert run_main(work, "--steps", "2", base=OLD) == 0
    command = ["--steps", "2", "--auto-resume"]
    capsys.readouterr()
    assert run_main(work, *command, base=NEW) == 2
    line = one_error_line(capsys.readouterr().err, "--auto-resume: the flags that define the run differ from")
    assert ways_out(line) == {"--overwrite"} and as_typed(line, "--overwrite"), line
    assert run_main(work, *command, "--overwrite", base=NEW) == 2  # the control: beside it, refused
    assert "drop --overwrite" in capsys.readouterr().err
    assert run_main(work, *instead(command, "--overwrite"), base=NEW) == 0
    assert [m["step"] for m in metrics(work)] == [1, 2] and not (work / lock.PREVIOUS).exists()


def test_resume_of_another_run_names_overwrite_in_place_of_resume_and_that_works(tmp_path, capsys):
    """The same for --resume's refusal of another run: "or --overwrite" beside --resume is refused
    ("give one of them"), so the line says in place of it, and that works as typed."""
    work = tmp_path / "run"
    assert run_main(work, "--steps", "2", base=OLD) == 0
    command = ["--steps", "2", "--resume"]
    capsys.readouterr()
    assert run_main(work, *command, base=NEW) == 2
    line = one_error_line(capsys.readouterr().err, "--resume: the flags that define the run differ from")
    assert line.endswith("or start a new run (another --output-dir, or --overwrite in place of --resume)"), line
    assert run_main(work, *command, "--overwrite", base=NEW) == 2  # the control: beside it, refused
    assert "give one of them" in capsys.readouterr().err
    assert run_main(work, *instead(command, "--overwrite", start="--resume"), base=NEW) == 0
    assert [m["step"] for m in metrics(work)] == [1, 2] and not (work / lock.PREVIOUS).exists()


# ------------------------------------------------------------------ a finished run whose export was killed

def finished_hf_run(base: Path) -> tuple[Path, list[str]]:
    """A Hugging Face run complete at --steps 1 (a tiny Llama, one real checkpoint) whose end-of-run
    export was killed: ``.final.tmp`` is left, ``final/`` never written. Returns (the run, its flags)."""
    transformers = pytest.importorskip("transformers")
    import tiny_models  # examples/tiny_models.py (tests/conftest.py puts it on the path)
    import torch

    from gradnorm.dist import state as dist_state
    from gradnorm.trainer.checkpoint import store
    from gradnorm.trainer.config import parse_config
    from gradnorm.trainer.guards import outpaths
    from gradnorm.trainer.ownership.history import write_config

    model_dir = tiny_models.build_tiny_llama(base / "model", seed=0)
    prompts, run = base / "prompts.jsonl", base / "run"
    prompts.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4"}\n')
    flags = ["--model", str(model_dir), "--prompts", str(prompts), "--steps", "1", "--output-dir", str(run),
             "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--warmup-steps", "0",
             "--eval-prompts", "1", "--no-plot"]
    run.mkdir()
    (run / lock.MARKER).write_text('{"by": "gradnorm/train.py"}\n')
    write_config(run, parse_config(flags), 1, 0)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    store.save(run, 1, dist_state.training_state(model, torch.optim.AdamW(model.parameters())), {"step": 1}, rank=0)
    outpaths.create(outpaths.temporary(run / "final"))  # what a kill mid-export leaves: run/.final.tmp, marked
    return run, flags


@pytest.mark.launch
def test_auto_resume_of_a_finished_run_with_a_killed_export_names_the_export_command(tmp_path, capsys):
    """Issue 54, finding: --auto-resume of a run whose end-of-run export was killed said "complete at
    step N: nothing to do", exit 0, and final/ was never written, where plain --resume names the
    export command. Exit 0 stays; the line names the command, which, typed as named, writes final/."""
    from gradnorm.trainer.guards import outpaths

    run, flags = finished_hf_run(tmp_path)
    assert main([*flags, "--auto-resume"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "nothing to do" in line]
    assert len(said) == 1 and said[0].startswith(f"--auto-resume: {run} is complete at step 1 (--steps 1)"), said
    typed = re.search(r"the run's export did not finish \(a killed export left .*\.final\.tmp\): (.*) writes it "
                      r"from ckpt_step1$", said[0])
    assert typed, said[0]
    command = shlex.split(typed.group(1))
    assert command[:3] == ["python", "-m", "gradnorm.export"], command
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # as typed in a checkout
    env = {**ENV, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert outpaths.is_export(run / "final") and (run / "final" / "model.safetensors").is_file()
    # the control: with the export written, the same requeue has nothing more to name
    assert main([*flags, "--auto-resume"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "nothing to do" in line]
    assert said == [f"--auto-resume: {run} is complete at step 1 (--steps 1): nothing to do"], said


# ------------------------------------------------------------------ a failed write, with and without a checkpoint

FAILS = tiny(warmup_steps="0")  # the fault comes in a GRPO step: no warm-up before it


def full_disk_at(monkeypatch, step: int) -> None:
    """The rollout of ``step`` fails as a write onto a full disk does (no file named: a buffered write)."""
    honest = train_module.generate_rollout

    def rollout(*args, **kwargs):
        if kwargs["step"] == step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return honest(*args, **kwargs)

    monkeypatch.setattr(train_module, "generate_rollout", rollout)


@pytest.mark.parametrize("flags, says, way", [
    (["--save-every", "0"], "no checkpoint was written, so there is nothing to resume: start the run over (the same "
                            "command with --overwrite)", ["--overwrite"]),
    (["--save-every", "0", "--auto-resume"], "no checkpoint was written, so there is nothing to resume: start the "
                                             "run over (the same command again)", []),
    (["--save-every", "1"], "the checkpoints written so far are intact, and --resume continues from the latest once "
                            "the cause is fixed", ["--resume"]),
], ids=["save-every-0", "save-every-0-auto-resume", "control-a-checkpoint"])
def test_a_failed_write_says_whether_there_is_a_checkpoint_to_resume_and_its_way_works(flags, says, way, tmp_path,
                                                                                     monkeypatch, capsys):
    """Issue 54, finding: a run on a full disk with --save-every 0 was told "the checkpoints written so
    far are intact, --resume continues" when there were none (--resume then refused: no checkpoint)."""
    out = tmp_path / "run"
    command = ["--steps", "3", *flags]
    with monkeypatch.context() as patched:
        full_disk_at(patched, 3)
        assert run_main(out, *command, base=FAILS) == 1
    one_error_line(capsys.readouterr().err, f"step 3: could not write a file of the run (No space left on device); "
                                            f"{says}")
    assert run_main(out, *command, *way, base=FAILS) == 0  # the way the line names, the cause gone
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]


@pytest.mark.parametrize("checkpoint", [False, True], ids=["none", "control-one"])
def test_out_of_memory_claims_intact_checkpoints_only_where_there_are_some(checkpoint, tmp_path):
    """Issue 54, finding (the same line's other half): out of memory said "the checkpoints written so
    far are intact" with none written."""
    import torch

    from gradnorm.trainer.config import parse_config
    from gradnorm.trainer.guards.failures import explain

    cfg = parse_config([*FAILS, "--output-dir", str(tmp_path)])
    if checkpoint:
        (tmp_path / "ckpt_step2").mkdir()
    said = explain(torch.OutOfMemoryError("CUDA out of memory"), torch.device("cpu"), 3, cfg)
    assert said.startswith("step 3: out of memory on cpu (CUDA out of memory); raise --grad-accum-steps"), said
    assert said.endswith("; the checkpoints written so far are intact" if checkpoint else
                         "; no checkpoint was written, so there is nothing to resume: start the run over (the same "
                         "command with --overwrite)"), said


@pytest.mark.launch
def test_a_real_full_disk_with_save_every_0_says_there_is_nothing_to_resume(small_disk, capsys):  # noqa: F811
    """Issue 54, finding: the same line from a real full disk (a tmpfs of 32 KiB that metrics.jsonl
    fills), where --save-every 0 leaves no checkpoint to resume from."""
    disk = small_disk(32 << 10)
    out = disk / "run"
    assert main([*TINY, "--output-dir", str(out), "--steps", "400", "--save-every", "0", "--log-every", "400"]) == 1
    one_error_line(capsys.readouterr().err, "(No space left on device); no checkpoint was written, so there is "
                                            "nothing to resume: start the run over (the same command with --overwrite)")
    assert latest_checkpoint(out) is None
