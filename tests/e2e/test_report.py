"""--report-to tensorboard,wandb: what rank 0 logs, read back with each tool's own reader.

One 2-rank torchrun run (4 prompts x 4 completions, 3 steps, checkpoints at 2 and 3) logs to
TensorBoard and to W&B offline (WANDB_MODE=offline, no network). Then ckpt_step3 is deleted, as if
the run had died after logging step 3 but before checkpointing it, and ``--resume --steps 5``
continues from step 2. What must hold, read back from the files alone:

- every numeric key of every line of metrics.jsonl is in TensorBoard's event files (read with
  ``tensorboard.backend.event_processing.event_accumulator``) and in the W&B run's ``.wandb``
  files, under its own name, at its step, with its value;
- each curve has the steps 1..5 once: the step 3 the interrupted start logged is gone from both
  (its phase times differ from the resumed step 3's, so a leftover would show);
- the run's flags are the config of both; the learning curve is logged at the last step;
- the W&B run keeps one id over both starts, the second rewound to step 2.

The bad inputs are one ``error:`` line with exit 2 before any model is built: an unknown or
repeated name, a logger that cannot be imported, a log directory that cannot be written.
"""

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers.runfiles import metrics
from tests.helpers.skipping import skip_or_fail
from tests.helpers.trainer import tiny, torchrun_cmd

from gradnorm.train import main
from gradnorm.trainer.guards.launch import TORCHRUN_VARS
from gradnorm.trainer.logs.reporters import numeric

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--warmup-steps", "2", "--eval-prompts", "4",
         "--save-every", "2", "--report-to", "tensorboard,wandb"]


@pytest.fixture(scope="module")
def report_extra():
    """tensorboard and wandb: the optional extra `report` (`make install` has it); CI fails without."""
    missing = [name for name in ("tensorboard", "wandb") if importlib.util.find_spec(name) is None]
    if missing:
        skip_or_fail(f"--report-to needs {' and '.join(missing)}: pip install -e '.[report]'")


def offline_env(tmp: Path) -> dict:
    """No network and no file outside the test's directories: W&B offline, its caches in ``tmp``."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("WANDB_")}
    return {**env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
            "WANDB_CACHE_DIR": str(tmp / "wandb-cache"), "WANDB_DATA_DIR": str(tmp / "wandb-data")}


def torchrun(out: Path, env: dict, *flags: str) -> None:
    cmd = torchrun_cmd(out, *flags, base=SMALL)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="module")
def run(tmp_path_factory, report_extra):
    """The run directory after 3 steps, a lost ckpt_step3 and a --resume to 5; the lines before the resume."""
    tmp = tmp_path_factory.mktemp("report")
    out, env = tmp / "run", offline_env(tmp)
    torchrun(out, env, "--steps", "3")
    first = metrics(out)
    shutil.rmtree(out / "ckpt_step3")  # died after logging step 3, before its checkpoint
    torchrun(out, env, "--steps", "5", "--resume")
    return out, first


# ------------------------------------------------------------------ reading TensorBoard and W&B back


def tensorboard_events(out: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    return events.Reload()  # purges what a start logged after the checkpoint the next start resumed


def wandb_records(path: Path):
    """The records of one ``.wandb`` file: a LevelDB-style log of 32 KiB blocks holding protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), path
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if length == 0 and kind == 0:  # the zero padding at the end of a block
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(out: Path) -> dict:
    """Every start's run record, and the curve as ``wandb sync`` replays them: in order, each
    rewound to its branch point first."""
    starts, history, twice = [], {}, []
    for directory in sorted((out / "wandb").glob("offline-run-*")):
        (path,) = directory.glob("run-*.wandb")
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                starts.append(record.run)
                if record.run.HasField("branch_point"):
                    history = {s: row for s, row in history.items() if s <= record.run.branch_point.value}
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}  # a logged image is nested: learning_curve/path
                if "_step" in row:  # else W&B's own bookkeeping
                    twice += [row["_step"]] if row["_step"] in history else []
                    history[row["_step"]] = {**row, "files": directory / "files"}
    return {"starts": starts, "history": history, "twice": twice}


# ------------------------------------------------------------------ the run, read back


@pytest.mark.slow
def test_tensorboard_has_every_numeric_key_at_every_step_once(run):
    out, first = run
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5]
    assert lines[2]["time_rollout_s"] != first[2]["time_rollout_s"]  # the two step 3s can be told apart
    events = tensorboard_events(out)
    keys = set().union(*(numeric(m) for m in lines))
    assert keys <= set(events.Tags()["scalars"]) and {"loss", "grad_norm", "reward_mean", "time_counts_s"} <= keys
    for key in keys:
        logged = events.Scalars(key)
        expected = [(m["step"], m[key]) for m in lines if key in numeric(m)]
        assert [e.step for e in logged] == [step for step, _ in expected], key  # no step twice
        for event, (step, value) in zip(logged, expected):
            assert event.value == pytest.approx(value, rel=1e-6, abs=1e-30), (key, step)  # float32


@pytest.mark.slow
def test_tensorboard_has_the_flags_and_the_learning_curve(run):
    out, _ = run
    events = tensorboard_events(out)
    (tag,) = [t for t in events.Tags()["tensors"] if t.startswith("config")]
    texts = [e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)]
    assert [e.step for e in events.Tensors(tag)] == [0, 2]  # each start's flags, at the step it started from
    assert '"report_to": "tensorboard,wandb"' in texts[1] and '"world_size": 2' in texts[1]
    assert '"steps": 3' in texts[0] and '"steps": 5' in texts[1]
    images = events.Images("learning_curve")
    assert [i.step for i in images] == [5] and images[0].width > 100  # the first start's, at step 3, is purged


@pytest.mark.slow
def test_wandb_offline_has_every_numeric_key_at_every_step_once(run):
    out, _ = run
    found = wandb_run(out)
    lines = metrics(out)
    assert sorted(found["history"]) == [m["step"] for m in lines]
    assert found["twice"] == []  # no step logged again without a rewind before it
    for m in lines:
        row = found["history"][m["step"]]
        for key, value in numeric(m).items():
            assert row[key] == pytest.approx(value, rel=1e-12), (key, m["step"])
        assert "step" not in row and "rollout_digest" not in row


@pytest.mark.slow
def test_wandb_keeps_one_run_rewound_on_resume_with_the_flags_and_the_curve(run):
    out, _ = run
    found = wandb_run(out)
    first, resumed = found["starts"]
    assert first.run_id == resumed.run_id == (out / "wandb" / "run_id").read_text().strip()
    assert not first.HasField("branch_point") and resumed.branch_point.value == 2
    config = {item.key: json.loads(item.value_json) for item in first.config.update}
    assert config["report_to"] == "tensorboard,wandb" and config["world_size"] == 2 and config["steps"] == 3
    last = found["history"][5]
    assert last["learning_curve/_type"] == "image-file" and (last["files"] / last["learning_curve/path"]).is_file()
    assert not any(key.startswith("learning_curve") for step in (1, 2, 3, 4) for key in found["history"][step])
    assert not list(out.parent.glob("wandb*/**/*.wandb"))  # the W&B caches hold no run: it is all in out/


# ------------------------------------------------------------------ bad input: one line, exit 2, nothing built

QUICK = tiny(warmup_steps="0", seed=None)  # TINY, no warm-up, the default seed: a few seconds to a logger's first line


def one_line(code: int, out: str, err: str) -> str:
    assert code == 2 and out == "", (code, out, err)
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("value, says", [
    ("mlflow", "--report-to 'mlflow': expected none, or a comma list of distinct names from tensorboard, wandb"),
    ("tensorboard,tensorboard", "--report-to 'tensorboard,tensorboard': expected none, or a comma list"),
    ("none,wandb", "--report-to 'none,wandb': expected none"),
    ("", "--report-to '': expected none"),
])
def test_a_bad_name_is_one_line(value, says, tmp_path, capsys, monkeypatch):
    for variable in TORCHRUN_VARS:
        monkeypatch.delenv(variable, raising=False)
    code = main([*QUICK, "--report-to", value, "--output-dir", str(tmp_path / "run")])
    assert says in one_line(code, *capsys.readouterr())
    assert list(tmp_path.iterdir()) == []


def test_a_logger_that_cannot_be_imported_is_one_line(tmp_path, capsys, monkeypatch, report_extra):
    for variable in TORCHRUN_VARS:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setitem(sys.modules, "wandb", None)  # how a missing package imports
    code = main([*QUICK, "--report-to", "tensorboard,wandb", "--output-dir", str(tmp_path / "run")])
    err = one_line(code, *capsys.readouterr())
    assert "--report-to wandb: cannot import wandb (" in err and "pip install -e '.[report]'" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_log_directory_that_is_a_file_is_one_line(name, tmp_path, capsys, monkeypatch, report_extra):
    for variable in TORCHRUN_VARS:
        monkeypatch.delenv(variable, raising=False)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / name).write_text("not a directory")
    code = main([*QUICK, "--report-to", name, "--output-dir", str(tmp_path / "run")])
    err = one_line(code, *capsys.readouterr())
    assert f"--report-to {name}: log directory {tmp_path / 'run' / name} is a file, not a directory" in err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [name]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_log_directory_that_is_not_writable_is_one_line(tmp_path, capsys, monkeypatch, report_extra):
    for variable in TORCHRUN_VARS:
        monkeypatch.delenv(variable, raising=False)
    (tmp_path / "run" / "tensorboard").mkdir(parents=True, mode=0o555)
    code = main([*QUICK, "--report-to", "tensorboard", "--output-dir", str(tmp_path / "run")])
    assert "--report-to tensorboard: log directory" in one_line(code, *capsys.readouterr())


@pytest.mark.launch
def test_the_command_line_stops_on_a_broken_wandb_before_building_anything(tmp_path):
    """A real process, with a ``wandb`` on PYTHONPATH that fails to import (a broken install)."""
    (tmp_path / "pkgs" / "wandb").mkdir(parents=True)
    (tmp_path / "pkgs" / "wandb" / "__init__.py").write_text("raise ImportError('protobuf 3 is too old')\n")
    env = offline_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "pkgs"), str(ROOT)])
    proc = subprocess.run([sys.executable, "gradnorm/train.py", *QUICK, "--report-to", "wandb",
                           "--output-dir", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    err = one_line(proc.returncode, proc.stdout, proc.stderr)
    assert "--report-to wandb: cannot import wandb (protobuf 3 is too old)" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kept, says", [
    (b"\x00\xffgarbage\n", "holds no W&B run id ('\\x00\\ufffdgarbage'); delete it to log this resumed run as a new"),
    (b"", "holds no W&B run id (''); delete it"),
    (None, "is a directory, not the file that keeps the W&B run's id; remove it"),
])
def test_a_torn_or_replaced_run_id_file_is_one_line_naming_it(kept, says, tmp_path, monkeypatch, report_extra):
    """Before, a corrupted wandb/run_id failed in wandb.init with "unset WANDB_MODE to log offline" (it was
    offline already), and a directory there was an IsADirectoryError."""
    from gradnorm.trainer.config import parse_config
    from gradnorm.trainer.logs.reporters import Reporters, read_run_id

    monkeypatch.setenv("WANDB_MODE", "offline")
    (tmp_path / "wandb").mkdir()
    id_file = tmp_path / "wandb" / "run_id"
    if kept is None:
        id_file.mkdir()
    else:
        id_file.write_bytes(kept)
    with pytest.raises(ValueError) as caught:
        Reporters(parse_config([*QUICK, "--report-to", "wandb"]), tmp_path, 1, step=3)
    assert str(caught.value).startswith(f"--report-to wandb: {id_file} ") and says in str(caught.value), caught.value
    id_file.rmdir() if kept is None else id_file.write_text("0123abcd\n")  # the control: an id this trainer writes
    assert kept is None or read_run_id(id_file) == "0123abcd"
