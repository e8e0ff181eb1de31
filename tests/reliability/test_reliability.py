"""Reliability of the trainer: bad input is one clear line, a crash loses nothing, a run resumes anywhere.

docs/reliability.md is the table of faults, behaviours and the tests that prove them; this file
holds the tests that the other test files did not already have.

- Bad rewards, NaN losses and empty responses are injected in-process: ``main()`` of
  gradnorm/train.py runs in this process with one function monkeypatched (the task's reward, the
  per-token loss, the sampler). No fault-injection flag exists in the trainer itself.
- Bad checkpoints (missing, truncated, foreign, malicious) go through ``--resume``; the sharded
  format's own faults (a save killed mid-write, a full disk) are in tests/e2e/test_checkpoints.py.
- The slow tests launch ``torchrun --nproc_per_node=2``: SIGKILL of one rank at a checkpoint
  marker, then ``--resume`` against the session's shared uninterrupted twin; and a checkpoint
  moved between world sizes 2 -> 1 and 1 -> 2.
"""

import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.helpers.faults import Evil, rank_1_worker, wait_for_file
from tests.helpers.launches import KILLED
from tests.helpers.runfiles import assert_same_steps, comparable, launch_all, metrics
from tests.helpers.trainer import TINY, one_error_line, run_main, torchrun_cmd

from gradnorm import train
from gradnorm.dist import state as dist_state
from gradnorm.models import tinygpt as tinygpt_module
from gradnorm.tasks import RepeatTask
from gradnorm.train import main
from gradnorm.trainer.checkpoint import checksums, store
from gradnorm.trainer.rollout import check_rewards

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def assert_finite_weights(path: Path) -> None:
    for name, tensor in store.read_tensors(path, "model").items():
        assert torch.isfinite(tensor).all(), name


# ------------------------------------------------------------------ rewards


@pytest.mark.parametrize("rewards, says", [
    (torch.tensor([0.5, float("nan"), 0.1, 0.0]), "non-finite reward"),
    (torch.tensor([0.5, float("inf"), 0.1, 0.0]), "non-finite reward"),
    (torch.tensor([0.5, 0.1, float("-inf"), 0.0]), "non-finite reward"),
    (torch.zeros(3), "shape (3,), expected (4,)"),
    (torch.zeros(4, 1), "shape (4, 1), expected (4,)"),
    ([0.5, 0.1, 0.1, 0.0], "returned list, expected a tensor"),
])
def test_a_bad_reward_is_a_one_line_error(rewards, says):
    with pytest.raises(ValueError, match="fix the task's reward") as err:
        check_rewards(rewards, 4)
    assert says in str(err.value) and "\n" not in str(err.value)
    assert check_rewards(torch.tensor([0.0, 1.0, 0.5, 0.25]), 4).dtype == torch.float32


def test_the_trainer_stops_on_a_nan_reward_with_one_line(tmp_path, monkeypatch, capsys):
    honest = RepeatTask.reward

    def nan_reward(self, responses, answers):
        r = honest(self, responses, answers)
        r[0] = float("nan")
        return r

    monkeypatch.setattr(RepeatTask, "reward", nan_reward)
    assert run_main(tmp_path / "run", "--steps", "2") != 0
    one_error_line(capsys.readouterr().err, "non-finite reward")


# ------------------------------------------------------------------ NaN loss or gradient


def poison_losses(monkeypatch, bad_steps):
    """Make the per-token loss NaN on the given steps (one microbatch per step with W = A = 1)."""
    honest, calls = train.grpo_token_losses, []

    def poisoned(*args, **kwargs):
        calls.append(None)
        terms = honest(*args, **kwargs)
        if bad_steps is None or len(calls) in bad_steps:
            terms.loss = terms.loss * float("nan")
        return terms

    monkeypatch.setattr(train, "grpo_token_losses", poisoned)


def test_a_nan_loss_skips_the_update_warns_and_is_counted(tmp_path, monkeypatch, capsys):
    poison_losses(monkeypatch, {2})
    out = tmp_path / "run"
    assert run_main(out, "--steps", "4", "--save-every", "1") == 0
    err = capsys.readouterr().err
    assert "warning: step 2: non-finite loss or gradient" in err and "Traceback" not in err
    rows = metrics(out)
    assert [m["skipped_steps"] for m in rows] == [0, 1, 1, 1]
    assert rows[1]["grad_norm"] is None and rows[1]["loss"] is None  # logged as null, never NaN
    assert all(isinstance(m["grad_norm"], float) for m in rows if m["step"] != 2)
    step1, step2 = (store.read_tensors(out / f"ckpt_step{s}", "model") for s in (1, 2))
    for name, tensor in step1.items():  # the skipped step left the weights as they were
        assert torch.equal(tensor, step2[name]), name
    assert_finite_weights(out / "ckpt_step4")


def test_too_many_nan_steps_in_a_row_stop_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    poison_losses(monkeypatch, None)
    out = tmp_path / "run"
    assert run_main(out, "--steps", "6", "--save-every", "1", "--max-skipped-steps", "2") == 1
    one_error_line(capsys.readouterr().err, "2 steps in a row had a non-finite loss or gradient")
    assert [m["skipped_steps"] for m in metrics(out)] == [1, 2]
    assert_finite_weights(out / "ckpt_step1")


# ------------------------------------------------------------------ empty responses


def test_responses_that_are_only_eos_train_with_finite_metrics(tmp_path, monkeypatch):
    """Every sampled response is EOS at once: 1 token each, equal rewards, zero advantages."""

    def eos_first(model, prompts, max_new_tokens, eos_id, pad_id, **kwargs):
        response = torch.full((len(prompts), max_new_tokens), pad_id, dtype=torch.long, device=prompts.device)
        response[:, 0] = eos_id
        return torch.cat([prompts, response], dim=1)

    monkeypatch.setattr(tinygpt_module, "generate", eos_first)  # what TinyGPTPolicy.sample calls
    out = tmp_path / "run"
    assert run_main(out, "--steps", "2", "--grad-accum-steps", "2", "--shard", "length") == 0
    for m in metrics(out):
        assert m["response_len_max"] == 1 and m["tokens"] == 4 and m["skipped_steps"] == 0
        assert all(v is not None for v in m.values()), m
        assert m["grad_norm"] == 0.0 and m["loss"] == 0.0
    assert_finite_weights(out / "ckpt_step2")


# ------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("good")
    assert run_main(out, "--steps", "2") == 0
    return out / "ckpt_step2"


def poison_a_tensor(path: Path, payload) -> None:
    """Point one stored tensor of the checkpoint at ``torch.save(payload)`` appended to its data file.

    The test trusts its own .metadata, so it may use plain pickle here; the trainer never does.
    The attacker recomputes both files' checksums, so the safe unpickler is what must refuse it.
    """
    metadata = pickle.loads((path / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn.startswith("model."))
    info = metadata.storage_data[index]
    data, buffer = path / info.relative_path, io.BytesIO()
    torch.save(payload, buffer)
    info.offset, info.length = data.stat().st_size, len(buffer.getvalue())
    with open(data, "ab") as f:
        f.write(buffer.getvalue())
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    checksums.write(data)
    checksums.write(path / ".metadata")


def bad_checkpoint(kind, directory: Path, good: Path, target: Path) -> None:
    path = directory / "ckpt_step2"  # good's own step: a checkpoint under another step's name is refused as such
    if kind != "missing":
        shutil.copytree(good, path)
    if kind == "truncated":
        data = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif kind == "foreign":  # a valid DCP checkpoint of something else, with the trainer's JSON beside it
        for part in path.glob("*.distcp"):
            part.unlink()
        (path / ".metadata").unlink()
        dist_state.write({"weights": torch.zeros(3)}, path)
    elif kind == "not-torch":
        (path / ".metadata").write_text("this is not a checkpoint\n")
    elif kind == "malicious-pickle":  # with its checksum recomputed: the unpickler must hold the line
        (path / ".metadata").write_bytes(pickle.dumps(Evil(target)))
        checksums.write(path / ".metadata")
    elif kind == "malicious-torch":
        poison_a_tensor(path, {"weights": Evil(target)})


@pytest.mark.parametrize("kind, says", [
    ("missing", "no complete checkpoint ckpt_step*/ in"),
    ("truncated", "is truncated or corrupt"),
    ("not-torch", "is truncated or corrupt"),
    ("foreign", "is not a gradnorm trainer checkpoint (no RNG states)"),
    ("malicious-pickle", "refused by the safe unpickler of its .metadata: it references posix.system"),
    ("malicious-torch", "refused by the safe unpickler (weights_only=True): it references posix.system"),
])
def test_a_bad_checkpoint_is_one_line_and_never_executed(kind, says, tmp_path, good_checkpoint, capsys):
    out, target = tmp_path / "run", tmp_path / "PWNED"
    out.mkdir()
    bad_checkpoint(kind, out, good_checkpoint, target)
    assert run_main(out, "--steps", "10", "--resume") != 0
    one_error_line(capsys.readouterr().err, says)
    assert not target.exists()  # the pickle's os.system never ran


def _overwrite_inside(path: Path, offset_share: float = 0.5) -> None:
    """8 bytes overwritten in the middle of the file: the same size, still a valid archive or JSON."""
    data = bytearray(path.read_bytes())
    at = int(len(data) * offset_share)
    data[at:at + 8] = bytes(255 - b for b in data[at:at + 8])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["shard", "trainer_state"])
def test_bytes_changed_inside_a_checkpoint_are_one_line_naming_the_file_and_the_one_before(where, tmp_path,
                                                                                          good_checkpoint, capsys):
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(good_checkpoint, out / "ckpt_step1")  # an earlier complete checkpoint to fall back on
    shutil.copytree(good_checkpoint, out / "ckpt_step2")
    if where == "shard":
        name = max((out / "ckpt_step2").glob("*.distcp"), key=lambda p: p.stat().st_size).name
        _overwrite_inside(out / "ckpt_step2" / name)
    else:  # a digit of a counter changed: the JSON still parses
        name = "trainer_state.json"
        state = out / "ckpt_step2" / name
        state.write_text(state.read_text().replace('"skipped": 0', '"skipped": 7'))
        assert json.loads(state.read_text())["skipped"] == 7
    assert run_main(out, "--steps", "4", "--resume") != 0
    err = capsys.readouterr().err
    one_error_line(err, f"ckpt_step2 is truncated or corrupt ({name} does not match the sha256 written with it)")
    one_error_line(err, "(the checkpoint before it: ckpt_step1)")


def test_control_an_untouched_checksummed_checkpoint_resumes(tmp_path, good_checkpoint):
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(good_checkpoint, out / "ckpt_step2")
    shutil.copy(good_checkpoint.parent / "config.json", out / "config.json")
    assert sorted(p.name for p in good_checkpoint.glob("*.sha256")) == sorted(
        [p.name + ".sha256" for p in good_checkpoint.glob("*.distcp")] + [".metadata.sha256", "trainer_state.json.sha256"])
    assert run_main(out, "--steps", "3", "--resume") == 0
    assert checksums.verify_file(out / "ckpt_step3", "trainer_state.json") is None
    assert sorted(p.name for p in (out / "ckpt_step3").glob("manifest.*")) == ["manifest.rank0.json"]


def _verify_with_a_corrupt_second_file(ctx, directory):
    return checksums.verify(Path(directory), ctx.rank, ctx.world_size)


@pytest.mark.launch
def test_ranks_split_the_checksums_and_all_refuse_with_the_same_words(tmp_path):
    from gradnorm.dist.spawn import spawn_gloo

    for name in ("__0_0.distcp", "__1_0.distcp", "__2_0.distcp", ".metadata"):
        (tmp_path / name).write_bytes(name.encode() * 100)
    for rank, names in enumerate([["__0_0.distcp", ".metadata"], ["__1_0.distcp"], ["__2_0.distcp"]]):
        checksums.seal(tmp_path, rank, 3, 5, names)  # written by 3 ranks at step 5 (an unnamed directory)
    # the files in order: .metadata, __0_0, __1_0, __2_0; rank 1 of 2 hashes files 1 and 3, rank 0 files 0 and 2
    _overwrite_inside(tmp_path / "__2_0.distcp")  # checked by rank 1 alone
    says = spawn_gloo(_verify_with_a_corrupt_second_file, 2, str(tmp_path))
    assert says == ["__2_0.distcp does not match the sha256 written with it"] * 2
    checksums.write(tmp_path / "__2_0.distcp")  # the control: recomputed, every file matches
    assert spawn_gloo(_verify_with_a_corrupt_second_file, 2, str(tmp_path)) == [None, None]


def test_a_checkpoint_of_another_model_names_the_flags(tmp_path, good_checkpoint, capsys):
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(good_checkpoint, out / "ckpt_step2")
    assert main([*TINY, "--n-embd", "32", "--output-dir", str(out), "--steps", "4", "--resume"]) != 0
    one_error_line(capsys.readouterr().err, "holds a different model")


@pytest.mark.launch
def test_the_cli_prints_one_line_for_a_malicious_checkpoint(tmp_path, good_checkpoint):
    """The same through ``python gradnorm/train.py``: exit code, one line, no traceback, nothing run."""
    out, target = tmp_path / "run", tmp_path / "PWNED"
    out.mkdir()
    bad_checkpoint("malicious-pickle", out, good_checkpoint, target)
    proc = subprocess.run([sys.executable, "gradnorm/train.py", *TINY, "--output-dir", str(out), "--resume"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "refused by the safe unpickler" in proc.stderr
    assert not target.exists()


# ------------------------------------------------------------------ determinism


def test_two_runs_with_the_same_seed_write_identical_metrics(tmp_path):
    assert run_main(tmp_path / "a", "--steps", "3") == 0
    assert run_main(tmp_path / "b", "--steps", "3") == 0
    assert comparable(tmp_path / "a") == comparable(tmp_path / "b")
    assert run_main(tmp_path / "c", "--steps", "3", "--seed", "4") == 0  # and the seed matters
    assert comparable(tmp_path / "c") != comparable(tmp_path / "a")


# ------------------------------------------------------------------ multi-process: crash and world size


def single_cmd(out: Path, *flags: str) -> list[str]:
    return [sys.executable, "gradnorm/train.py", *TINY, "--output-dir", str(out), *flags]


@pytest.mark.slow
def test_sigkill_of_one_rank_ends_the_job_and_resume_matches_an_uninterrupted_run(tmp_path, launched):
    """Rank 1 SIGKILLed at a marker its run writes (ckpt_step4, 20 steps before the end): the job
    ends, the checkpoint before the kill loads, and --resume logs what the session's uninterrupted
    twin (tests/helpers/launches.py) logs."""
    psutil = pytest.importorskip("psutil")
    crashed = tmp_path / "crashed"
    launched.start("twin-w2-24")
    job = subprocess.Popen(torchrun_cmd(crashed, *KILLED), cwd=ROOT, env=ENV, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while (victim := rank_1_worker(psutil, job.pid)) is None:  # found early: the kill follows the marker at once
            assert job.poll() is None and time.monotonic() < deadline, "no worker with RANK=1"
            time.sleep(0.02)
        wait_for_file(crashed / "ckpt_step4", job, deadline)
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        output, _ = job.communicate(timeout=60)
        exit_s = time.monotonic() - killed_at
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode != 0, output
    assert exit_s < 60
    print(f"torchrun exited {job.returncode} {exit_s:.1f} s after the SIGKILL")
    latest = store.latest_checkpoint(crashed)
    assert latest is not None and not list(crashed.glob(".ckpt_step*.tmp"))  # no torn write left behind
    assert_finite_weights(latest)  # loads through the safe readers
    assert len(metrics(crashed)) < 24

    launch_all([torchrun_cmd(crashed, *KILLED, "--resume")], ROOT, ENV)
    assert [m["step"] for m in comparable(crashed)] == list(range(1, 25))
    assert comparable(crashed) == comparable(launched("twin-w2-24"))


@pytest.mark.slow
def test_a_token_run_resumes_on_another_world_size(tmp_path):
    flags = ["--steps", "4", "--save-every", "2", "--loss-denominator", "token"]
    two, one = tmp_path / "two", tmp_path / "one"
    launch_all([torchrun_cmd(two, *flags), single_cmd(one, *flags)], ROOT, ENV)
    # 2 -> 1: the 2-rank run's step-2 checkpoint, continued by one plain process; and
    # 1 -> 2: the single process's step-2 checkpoint, continued on 2 ranks.
    two_to_one, one_to_two = tmp_path / "two_to_one", tmp_path / "one_to_two"
    for source, copy in ((two, two_to_one), (one, one_to_two)):
        shutil.copytree(source, copy)
        shutil.rmtree(copy / "ckpt_step4")
    launch_all([single_cmd(two_to_one, *flags, "--resume"), torchrun_cmd(one_to_two, *flags, "--resume")], ROOT, ENV)
    assert_same_steps(two_to_one, two)
    assert_same_steps(one_to_two, one)
    assert [len(m["tokens_per_rank"]) for m in metrics(one_to_two)] == [1, 1, 2, 2]
