"""A full disk is one line that says so, at every write of a run, and leaves nothing torn; so is a
directory standing where a run file belongs.

Each case runs the trainer into a small tmpfs (mounted here, which needs root; skipped with the
reason otherwise): full before the run's first file, at a checkpoint (torch's writer says only
"unexpected pos"), and while appending metrics.jsonl. The control of each is the same run on a
filesystem with room, which succeeds.
"""

import pytest
from tests.helpers.faults import fill
from tests.helpers.trainer import TINY, one_error_line

from gradnorm.train import main


@pytest.mark.launch
def test_a_full_disk_before_the_first_file_is_one_line(small_disk, capsys):
    disk = small_disk(1 << 20)
    fill(disk)
    assert main([*TINY, "--output-dir", str(disk / "run"), "--steps", "1"]) == 1
    one_error_line(capsys.readouterr().err, "(No space left on device); nothing was trained")


@pytest.mark.launch
def test_a_full_disk_at_a_checkpoint_names_it_and_leaves_no_temporary_files(small_disk, capsys):
    disk = small_disk(64 << 10)  # the records fit, a checkpoint of the tiny model does not
    out = disk / "run"
    assert main([*TINY, "--output-dir", str(out), "--steps", "1", "--save-every", "1"]) == 1
    err = capsys.readouterr().err
    one_error_line(err, f"step 1: could not write checkpoint {out / 'ckpt_step1'} (")
    assert "no space left on device" in err.lower()
    assert not list(out.glob(".ckpt_step*.tmp")) and not list(out.glob("ckpt_step*"))


@pytest.mark.launch
def test_a_full_disk_while_appending_metrics_is_one_line(small_disk, capsys):
    disk = small_disk(32 << 10)  # a few pages: step lines fill it long before step 400
    out = disk / "run"
    assert main([*TINY, "--output-dir", str(out), "--steps", "400", "--save-every", "0", "--log-every", "400"]) == 1
    err = capsys.readouterr().err
    one_error_line(err, "could not write")
    assert "No space left on device" in err
    assert not (out / ".config.json.tmp").exists()


@pytest.mark.launch
def test_control_the_same_run_with_room_succeeds(small_disk, capsys):
    disk = small_disk(64 << 20)
    assert main([*TINY, "--output-dir", str(disk / "run"), "--steps", "1", "--save-every", "1"]) == 0
    assert (disk / "run" / "ckpt_step1").is_dir()


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.json", "warmup.json"])
def test_a_directory_where_a_run_file_belongs_is_one_line(tmp_path, capsys, name):
    out = tmp_path / "run"
    flags = [*TINY, "--output-dir", str(out), "--save-every", "1"]
    assert main([*flags, "--steps", "1"]) == 0
    (out / name).unlink()
    (out / name).mkdir()  # someone's mkdir, a sync tool's conflict copy
    code = main([*flags, "--steps", "2", "--resume"])
    err = capsys.readouterr().err
    assert code in (1, 2), err
    one_error_line(err, name)
