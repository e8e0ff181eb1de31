"""User code that calls sys.exit() or raises KeyboardInterrupt fails in one line; it never ends a
command with its own exit code (0 would read as success) or with a traceback.

The reward of the trainer (gradnorm.tasks.rewards, which the pre-training eval and every rollout
call) and the loss of the audit (gradnorm.audit.measurement, at import and at every call) are the
user code, both loaded by gradnorm.cli.usercode; each case below is what a careless function does.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gradnorm.audit.cli import main as audit
from gradnorm.cli.usercode import ProcessExit, describe, no_process_exit
from gradnorm.tasks.rewards import RewardError, call_reward, get_reward


def exits_0(response, answer):
    sys.exit(0)


def exits_3(response, answer):
    sys.exit(3)


def interrupts(response, answer):
    raise KeyboardInterrupt


@pytest.mark.parametrize("fn, says", [
    (exits_0, "raised SystemExit(0) on sequence 2 (answer '7')"),
    (exits_3, "raised SystemExit(3) on sequence 2 (answer '7')"),
    (interrupts, "raised KeyboardInterrupt('') on sequence 2 (answer '7')"),
])
def test_a_reward_that_exits_or_interrupts_is_a_reward_error(fn, says):
    with pytest.raises(RewardError) as caught:
        call_reward(fn, "response", "7", 2)
    assert f"reward function {__name__}:{fn.__name__} {says}" == caught.value.summary


def test_a_reward_module_that_exits_at_import_is_a_reward_error(tmp_path, monkeypatch):
    (tmp_path / "exiting_reward_module.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError) as caught:
        get_reward("exiting_reward_module:score")
    assert caught.value.summary == "reward function exiting_reward_module:score failed to import: SystemExit(0)"


def test_no_process_exit_turns_os_exit_into_an_exception_and_puts_it_back():
    real = os._exit
    with pytest.raises(ProcessExit) as caught, no_process_exit():
        os._exit(3)
    assert caught.value.code == 3 and describe(caught.value) == "os._exit(3)"
    assert os._exit is real  # the control: outside the block os._exit is the real one again


LOSSES = '''
import sys

def exits_0(logp, old_logp, advantages, mask):
    sys.exit(0)

def exits_3(logp, old_logp, advantages, mask):
    sys.exit(3)

def interrupts(logp, old_logp, advantages, mask):
    raise KeyboardInterrupt("stop")
'''


@pytest.mark.parametrize("source, name, says", [
    (LOSSES, "exits_0", "the loss raised SystemExit(0) (W=1 "),
    (LOSSES, "exits_3", "the loss raised SystemExit(3) (W=1 "),
    (LOSSES, "interrupts", "the loss raised KeyboardInterrupt: stop (W=1 "),
    ("import sys\nsys.exit(0)\n", "f", "exiting_at_import.py: SystemExit(0)"),
])
def test_an_audited_loss_that_exits_or_interrupts_is_exit_2_and_one_line(source, name, says, tmp_path, capsys):
    path = tmp_path / ("losses.py" if source is LOSSES else "exiting_at_import.py")
    path.write_text(textwrap.dedent(source))
    code = audit([f"{path}:{name}", "--world-size", "2", "--accum-steps", "1", "--sharding", "interleave"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and says in err, err


SLOW_LOSS = '''
import pathlib, time

def waits(logp, old_logp, advantages, mask):
    pathlib.Path(__file__).with_name("started").touch()  # the marker: the audit is inside the loss
    time.sleep(60)
    return logp.sum()
'''


@pytest.mark.launch
def test_a_real_ctrl_c_during_the_audit_is_exit_130_and_one_line(tmp_path):
    """A SIGINT while the loss runs is the user stopping the command (130), not the loss failing (2: the
    control above, a loss that raises KeyboardInterrupt itself)."""
    (tmp_path / "slow.py").write_text(SLOW_LOSS)
    proc = subprocess.Popen([sys.executable, "-m", "gradnorm.audit", f"{tmp_path / 'slow.py'}:waits"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip() == "error: interrupted (Ctrl-C): no report" and out == ""


ENDS_THE_PROCESS = {  # a loss that ends its process in a way no Python guard can catch
    "os-exit-0-when-called": ("import os\ndef loss(logp, old_logp, advantages, mask, **counts):\n    os._exit(0)\n",
                              "exited with code 0 (os._exit in the loss or at its import?)"),
    "os-exit-0-at-import": ("import os\nos._exit(0)\n", "exited with code 0 (os._exit in the loss or at its import?)"),
    "kills-itself": ("import os, signal\ndef loss(logp, old_logp, advantages, mask, **counts):\n"
                     "    os.kill(os.getpid(), signal.SIGKILL)\n", "was killed by SIGKILL"),
}


@pytest.mark.launch
@pytest.mark.parametrize("name", ENDS_THE_PROCESS)
def test_the_audit_command_gives_no_verdict_when_the_loss_ends_its_process(name, tmp_path):
    """Before, ``os._exit(0)`` in an audited loss ended ``python -m gradnorm.audit`` with exit 0 and no
    output, which a CI gate reads as INVARIANT. The loss runs in a child; the command prints a
    verdict only from a report it received."""
    source, says = ENDS_THE_PROCESS[name]
    (tmp_path / "ends.py").write_text(source)
    done = subprocess.run([sys.executable, "-m", "gradnorm.audit", f"{tmp_path / 'ends.py'}:loss"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and "verdict:" not in done.stderr
    assert done.stderr.strip() == f"error: the audited code's process {says} before it sent a report: no verdict"


@pytest.mark.launch
def test_control_the_isolated_command_passes_on_a_real_report():
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-m", "gradnorm.audit", str(root / "examples" / "drop_in_ddp.py") + ":grpo_loss"],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr
    assert "verdict: INVARIANT" in done.stdout


HANGS = "import time\ndef loss(logp, old_logp, advantages, mask):\n    time.sleep(120)\n    return logp.sum()\n"


@pytest.mark.launch
def test_a_loss_that_hangs_ends_the_command_at_its_timeout_with_no_verdict(tmp_path):
    """Before, a loss that waited forever (a collective with no peers) hung the command and its CI job."""
    (tmp_path / "hangs.py").write_text(HANGS)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gradnorm.audit", f"{tmp_path / 'hangs.py'}:loss", "--timeout", "3"],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.strip() == ("error: the audited code did not finish in 3 s (--timeout): no verdict (a loss that "
                                   "waits on a collective, a lock or input never returns)")
    assert time.monotonic() - started < 60  # the child was killed, not waited for


@pytest.mark.launch
def test_the_audit_s_own_failure_in_the_child_is_one_line_not_a_guess_at_the_loss(monkeypatch, capsys):
    """An error of the audit itself (here: memory, forced) was reported as "exited with code 1 (os._exit in the
    loss?)" after a traceback; it is one line naming the error."""
    import gradnorm.audit.cli as cli

    def fails(argv):
        raise MemoryError("forced")

    monkeypatch.setattr(cli, "_run", fails)
    code = cli.main(["examples/drop_in_ddp.py:grpo_loss"], isolate=True)  # the child is forked: it sees the patch
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == "error: the audit failed: MemoryError: forced; no verdict\n", err
