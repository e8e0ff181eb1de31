"""Issue 54: the output directory's ``.lock`` is taken in one atomic step, and never blocks for good.

What must hold (gradnorm/trainer/ownership/lock.py):
- two starts that both find a killed run's lock: exactly one takes it (real processes, with the
  window the finding names held open: a second between judging the lock stale and taking it);
- the kernel's flock, not what the file says, decides whether a lock is live: a killed owner's lock
  (a real SIGKILL) is taken over with a warning; a live holder's is respected, whatever its file says;
- a start on a full disk leaves no empty ``.lock`` behind, and once space is freed the next start
  runs; an empty lock that no process holds is taken over, one a live process holds is respected.

The control of the race is the take-over the finding describes, written out longhand in ``RACE``
(check the pid, unlink, create): with the same hook, both of its starts take the lock.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers.faults import dead_pid
from tests.helpers.trainer import TINY, one_error_line
from tests.helpers.faults import fill

from gradnorm.train import main
from gradnorm.trainer.ownership import lock

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

RACE = """
import json, os, sys, time
from pathlib import Path
from gradnorm.trainer.ownership import lock

out, me, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
honest = lock._pid_alive

def slow(pid):  # the finding's window: between judging the lock stale and taking it over (staggered, so
    alive = honest(pid)  # that the second start's take-over comes after the first one's)
    time.sleep(1.0 + 0.5 * int(me))
    return alive

lock._pid_alive = slow

def check_then_unlink(out):
    # the take-over the finding describes, longhand: the control, which two starts both pass
    path = out / lock.LOCK
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = json.loads(path.read_text() or "{}")
            if isinstance(owner.get("pid"), int) and not lock._pid_alive(owner["pid"]):
                path.unlink(missing_ok=True)
                continue
            raise ValueError("in use by another run")
        os.write(fd, json.dumps({"pid": os.getpid()}).encode())
        return

(out.parent / f"ready-{me}").touch()
while not (out.parent / "go").exists():
    time.sleep(0.001)
try:
    lock.RunDir(out)._lock() if how == "trainer" else check_then_unlink(out)
except ValueError as err:
    print("refused:", err, flush=True)
    sys.exit(3)
print("took", flush=True)
time.sleep(4)  # a run holds its lock while the other start tries
"""


def race(tmp_path: Path, how: str) -> list[subprocess.CompletedProcess]:
    """Two real processes that both find a killed run's lock and try to take it at the same moment."""
    return start_race(tmp_path, how)()


def start_race(tmp_path: Path, how: str):
    """``race`` started: its processes wait on the lock while the caller goes on; call the result for them."""
    out = tmp_path / how / "run"
    out.mkdir(parents=True)
    (out / lock.LOCK).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname(), "started": "then"}))
    starts = [subprocess.Popen([sys.executable, "-c", RACE, str(out), str(i), how], cwd=ROOT, env=ENV, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    deadline = time.monotonic() + 300
    while not all((out.parent / f"ready-{i}").exists() for i in range(2)):  # both imported: start them together
        assert time.monotonic() < deadline and all(s.poll() is None for s in starts)
        time.sleep(0.01)
    (out.parent / "go").touch()
    return lambda: [subprocess.CompletedProcess(s.args, s.wait(timeout=120), *s.communicate()) for s in starts]


@pytest.mark.launch
def test_two_starts_that_find_a_killed_runs_lock_cannot_both_take_it(tmp_path):
    """Issue 54, finding: the stale-lock take-over was check-then-unlink; two starts that both found a
    dead run's lock could both take it (seen with the unlink delayed), then both trained into one directory."""
    control = start_race(tmp_path, "longhand")  # runs beside the trainer's race (each in its own directory)
    done = race(tmp_path, "trainer")
    took = [d for d in done if d.returncode == 0]
    assert len(took) == 1 and "took" in took[0].stdout, [(d.returncode, d.stdout, d.stderr) for d in done]
    refused = [d for d in done if d.returncode == 3]
    assert len(refused) == 1 and "is in use by another run" in refused[0].stdout, refused
    assert "taking it over" in took[0].stderr
    # the control: the longhand check-then-unlink, with the same window, lets both take it
    assert [d.returncode for d in control()] == [0, 0]


HOLD = """
import fcntl, os, sys, time
from gradnorm.trainer.ownership import lock
from pathlib import Path
out = Path(sys.argv[1])
if sys.argv[2] == "trainer":
    lock.RunDir(out)._lock()
else:  # a process that holds the lock file's flock and never writes it (a start still writing it)
    fcntl.flock(os.open(out / lock.LOCK, os.O_RDWR | os.O_CREAT, 0o644), fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(120)
"""


def holder(out: Path, how: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out), how], cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE)
    assert proc.stdout.readline() == "held\n"
    return proc


@pytest.mark.launch
def test_the_kernels_lock_decides_a_killed_owners_lock_is_free_and_a_live_ones_is_not(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    proc = holder(out, "trainer")
    try:
        owner = json.loads((out / lock.LOCK).read_text())
        assert owner["pid"] == proc.pid and owner["flock"] is True
        with pytest.raises(ValueError, match=f"in use by another run \\(pid {proc.pid} on host"):
            lock.check(out, resume=False, overwrite=False)
        # what the file says does not free a held lock: a live holder with a dead pid written into it
        (out / lock.LOCK).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname(), "flock": True}))
        with pytest.raises(ValueError, match="in use by another run"):
            lock.RunDir(out)._lock()
    finally:
        proc.send_signal(signal.SIGKILL)  # the kernel drops its flock; its file stays, naming a live-looking pid
        proc.wait(timeout=60)
    (out / lock.LOCK).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "flock": True}))
    lock.check(out, resume=False, overwrite=False)  # written under flock and held by none: stale, pid or not
    run_dir = lock.RunDir(out)
    run_dir._lock()
    assert f"was left by pid {os.getpid()}, which no longer holds it (a killed run); taking it over" in \
        capsys.readouterr().err
    assert json.loads((out / lock.LOCK).read_text())["pid"] == os.getpid()
    run_dir._unlock()
    assert not (out / lock.LOCK).exists()


@pytest.mark.launch
def test_a_full_disk_at_the_first_file_leaves_no_lock_and_the_next_start_runs(small_disk, capsys):
    """Issue 54, finding: a full disk at the very first file left an empty ``.lock`` (its write failed
    after the create); after space was freed every start was refused as "in use by another run (pid ?
    on host ?, since ?)"."""
    disk = small_disk(1 << 20)
    out = disk / "run"
    out.mkdir()
    fill(disk)
    assert main([*TINY, "--output-dir", str(out), "--steps", "1"]) == 1
    one_error_line(capsys.readouterr().err, "(No space left on device); nothing was trained")
    assert not (out / lock.LOCK).exists()
    (disk / "filler").unlink()
    assert main([*TINY, "--output-dir", str(out), "--steps", "1"]) == 0, capsys.readouterr().err


def test_a_lock_whose_write_failed_is_removed(tmp_path, monkeypatch):
    """The same finding where no tmpfs can be mounted: the lock's write fails (ENOSPC) and no lock is left."""
    def full(fd, text):
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(lock, "_rewrite", full)
    with pytest.raises(OSError, match="No space left on device"):
        lock.RunDir(tmp_path)._lock()
    assert not (tmp_path / lock.LOCK).exists()


@pytest.mark.launch
def test_an_empty_lock_no_process_holds_is_taken_over_and_one_a_process_holds_is_not(tmp_path, capsys):
    """Issue 54, finding (the same): an empty ``.lock`` blocked every start for good."""
    out = tmp_path / "run"
    out.mkdir()
    (out / lock.LOCK).touch()  # what the failed write left
    assert main([*TINY, "--output-dir", str(out), "--steps", "1"]) == 0
    assert f"{out / lock.LOCK} is empty or torn" in capsys.readouterr().err
    # the control: an empty lock that a live process holds (a start still writing it) is respected
    other = tmp_path / "other"
    other.mkdir()
    proc = holder(other, "empty")
    try:
        assert main([*TINY, "--output-dir", str(other), "--steps", "1"]) == 2
        one_error_line(capsys.readouterr().err, "is in use by another run (its lock names no owner yet: a start still writing it)")
        assert (other / lock.LOCK).read_text() == ""
    finally:
        proc.kill()
        proc.wait(timeout=60)
