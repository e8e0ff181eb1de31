"""Checksums that bind: each file of a checkpoint to its digest, and the digests to the checkpoint
and its step (``gradnorm.trainer.checkpoint.checksums``: a sidecar per file, a manifest per rank).

Each case edits a real checkpoint of the trainer the way the fault would, then resumes it (or reads
it as ``python -m gradnorm.export`` does, ``store.read_tensors``) and expects one line that names
what is wrong. The controls: the untouched checkpoint resumes, one with every checksum artifact
removed loads as a checkpoint written before checksums did, and an upper-case digest (which
``sha256sum -c`` takes) is taken too.
"""

import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from tests.helpers.trainer import one_error_line, run_main

from gradnorm.trainer.checkpoint import checksums, store

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """A run of 3 steps, a checkpoint after each: ckpt_step1..3 and config.json."""
    out = tmp_path_factory.mktemp("three")
    assert run_main(out, "--steps", "3", "--save-every", "1") == 0
    return out


def copy_run(source: Path, target: Path, *steps: int) -> Path:
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    for step in steps:
        shutil.copytree(source / f"ckpt_step{step}", target / f"ckpt_step{step}")
    return target


def largest_shard(ckpt: Path) -> Path:
    return max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)


def flip_8_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2
    data[at:at + 8] = bytes(255 - b for b in data[at:at + 8])
    path.write_bytes(bytes(data))


def remove_checksums(ckpt: Path) -> None:
    """Every sidecar and manifest gone: what a checkpoint written before checksums holds."""
    for artifact in ckpt.iterdir():
        if artifact.name.endswith(".sha256") or artifact.name.startswith("manifest."):
            artifact.unlink()


def resume_refuses(out: Path, capsys, says: str, steps: int = 4) -> str:
    assert run_main(out, "--steps", str(steps), "--resume") != 0
    return one_error_line(capsys.readouterr().err, says)


def test_a_deleted_sidecar_is_refused_not_read_as_a_checkpoint_before_checksums(three_steps, tmp_path, capsys):
    out = copy_run(three_steps, tmp_path / "run", 2)
    (out / "ckpt_step2" / ".metadata.sha256").unlink()  # the other sidecars and the manifest kept
    flip_8_bytes(largest_shard(out / "ckpt_step2"))
    resume_refuses(out, capsys, "ckpt_step2 is truncated or corrupt (")
    with pytest.raises(ValueError, match="is truncated or corrupt"):  # python -m gradnorm.export reads it so
        store.read_tensors(out / "ckpt_step2", "model")
    assert not (out / "ckpt_step3").exists()


def test_a_missing_sidecar_alone_is_refused_as_a_mismatch_would_be(three_steps, tmp_path, capsys):
    out = copy_run(three_steps, tmp_path / "run", 2)
    (out / "ckpt_step2" / ".metadata.sha256").unlink()
    resume_refuses(out, capsys, "(.metadata has no .sha256 checksum beside it)")


def test_a_missing_manifest_is_refused(three_steps, tmp_path, capsys):
    out = copy_run(three_steps, tmp_path / "run", 2)
    (out / "ckpt_step2" / "manifest.rank0.json").unlink()  # the sidecars kept
    resume_refuses(out, capsys, "(manifest.rank0.json is missing")


@pytest.mark.parametrize("with_manifest", [False, True])
def test_a_shard_copied_from_another_checkpoint_is_refused(with_manifest, three_steps, tmp_path, capsys):
    """A shard and its sidecar from ckpt_step2 in ckpt_step3 matched its sidecar: step-2 weights under
    step-3 counters. The manifest binds it; copying the manifest too binds the step-2 files to step 2."""
    out = copy_run(three_steps, tmp_path / "run", 3)
    shard = largest_shard(three_steps / "ckpt_step2").name
    names = [shard, shard + ".sha256"] + (["manifest.rank0.json"] if with_manifest else [])
    for name in names:
        shutil.copy(three_steps / "ckpt_step2" / name, out / "ckpt_step3" / name)
    says = "holds step 2 (manifest.rank0.json), not step 3" if with_manifest else f"({shard}.sha256 does not name"
    resume_refuses(out, capsys, says)
    with pytest.raises(ValueError, match=re.escape(says)):
        store.read_tensors(out / "ckpt_step3", "model")


def test_a_checkpoint_renamed_by_hand_is_refused_naming_both_steps(three_steps, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(three_steps / "config.json", out / "config.json")
    shutil.copytree(three_steps / "ckpt_step2", out / "ckpt_step9")
    line = resume_refuses(out, capsys, "ckpt_step9 holds step 2 (manifest.rank0.json)", steps=12)
    assert "not step 9 as its name says" in line and "ckpt_step2" in line
    assert sorted(p.name for p in out.glob("ckpt_step*")) == ["ckpt_step9"]  # nothing saved over
    remove_checksums(out / "ckpt_step9")  # a checkpoint written before checksums: its trainer_state.json says the step
    resume_refuses(out, capsys, "ckpt_step9 holds step 2 (trainer_state.json), not step 9", steps=12)


def test_control_a_checkpoint_without_any_checksum_loads_as_before(three_steps, tmp_path):
    out = copy_run(three_steps, tmp_path / "run", 2)
    remove_checksums(out / "ckpt_step2")
    assert not checksums.checked(out / "ckpt_step2")
    assert run_main(out, "--steps", "3", "--resume") == 0
    assert store.read_run_state(out / "ckpt_step3", required=("step",))["step"] == 3


def test_control_an_upper_case_digest_is_taken(three_steps, tmp_path):
    out = copy_run(three_steps, tmp_path / "run", 2)
    sidecar = out / "ckpt_step2" / ".metadata.sha256"
    digest, name = sidecar.read_text().split()
    sidecar.write_text(f"{digest.upper()}  {name}\n")
    assert subprocess.run(["sha256sum", "-c", ".metadata.sha256"], cwd=sidecar.parent, capture_output=True).returncode == 0
    assert run_main(out, "--steps", "3", "--resume") == 0


def test_a_sidecar_that_is_a_fifo_is_refused_without_blocking(three_steps, tmp_path):
    out = copy_run(three_steps, tmp_path / "run", 2)
    fifo = out / "ckpt_step2" / ".metadata.sha256"
    fifo.unlink()
    os.mkfifo(fifo)
    said = []

    def read():
        try:
            store.read_tensors(out / "ckpt_step2", "model")
        except ValueError as err:
            said.append(str(err))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)
    blocked = reader.is_alive()
    while reader.is_alive():  # blocked in open(): writers release it (each open of the FIFO), then the test fails
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no reader has it open
        except OSError:
            reader.join(timeout=0.1)
            continue
        os.write(fd, b"0" * 64 + b"  .metadata\n")
        os.close(fd)
        reader.join(timeout=0.1)
    assert not blocked, "the reader blocked on the FIFO"
    assert said and ".metadata.sha256 is not a regular file" in said[0], said


def test_the_docs_command_checks_every_sidecar_dot_files_included(three_steps):
    command = "sha256sum -c .metadata.sha256 *.sha256"
    docs = (ROOT / "docs/checkpoints.md").read_text()
    assert f"cd ckpt_step10 && {command}" in docs
    ckpt = three_steps / "ckpt_step2"
    sidecars = [p.name for p in ckpt.iterdir() if p.name.endswith(".sha256")]
    checked = subprocess.run(["bash", "-c", command], cwd=ckpt, capture_output=True, text=True)
    assert checked.returncode == 0 and sorted(checked.stdout.splitlines()) == sorted(
        f"{name[:-len('.sha256')]}: OK" for name in sidecars)
    missed = subprocess.run(["bash", "-c", "sha256sum -c *.sha256"], cwd=ckpt, capture_output=True, text=True)
    assert ".metadata: OK" not in missed.stdout  # the control: the glob alone skips the dot file
