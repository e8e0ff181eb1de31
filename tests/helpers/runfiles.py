"""What the trainer tests read back from a run directory, and how they launch runs."""

import subprocess
from pathlib import Path

from torch.testing import assert_close

from gradnorm.trainer.logs.curves import read_metrics
from gradnorm.trainer.logs.metrics import TIMING_KEYS
from gradnorm.trainer.ownership.lock import MARKER


def metrics(out: Path) -> list[dict]:
    """Every line of ``out/metrics.jsonl``, in order."""
    return read_metrics(out / "metrics.jsonl")


def comparable(out: Path) -> list[dict]:
    """The same lines without measurements (wall times, memory): what two identical runs share."""
    return [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in metrics(out)]


def every_file(directory: Path) -> dict[str, bytes]:
    """{path relative to ``directory``: bytes} of every file under it, in checkpoint directories too."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


MEANINGFUL = ("loss", "grad_norm", "reward_mean", "exact_match", "response_len_mean", "response_len_max", "tokens",
              "pg_loss", "entropy", "skipped_steps", "rollout_digest")


def assert_same_steps(resumed: Path, reference: Path, steps=(3, 4)) -> None:
    got = {m["step"]: m for m in metrics(resumed)}
    want = {m["step"]: m for m in metrics(reference)}
    assert sorted(got) == [1, 2, 3, 4]
    for n in steps:
        for key in MEANINGFUL:
            if isinstance(want[n][key], float):
                assert_close(got[n][key], want[n][key], rtol=1e-5, atol=1e-7, msg=f"step {n} {key}")
            else:
                assert got[n][key] == want[n][key], (n, key)


def launch_all(jobs: list[list[str]], cwd: Path, env: dict, at_once: int = 2, timeout: float = 300) -> None:
    """Run the commands ``jobs``, ``at_once`` at a time, each to success.

    A short torchrun launch spends much of its wall time with a core idle (the agent starting, the
    rendezvous, the workers' imports finishing at different times), so two launches side by side
    take well under twice one. Each must write its own output directory; no result may depend on
    timing.
    """
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < at_once:
            cmd = pending.pop(0)
            running.append((cmd, subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                                  stderr=subprocess.PIPE, text=True)))
        cmd, proc = running.pop(0)
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{out}\n{err[-4000:]}"


def old_run(out: Path) -> dict[str, bytes]:
    """A run shaped as the trainer leaves one: its marker, records, checkpoints at steps 8 and 10
    (``ckpt_step10`` sorts first, so a move in name order takes the latest first) and a torn one."""
    out.mkdir(parents=True)
    (out / MARKER).write_text('{"by": "gradnorm/train.py"}\n')
    (out / "config.json").write_text('{"seed": 3, "history": []}\n')
    (out / "metrics.jsonl").write_text('{"step": 10}\n')
    for name in ("ckpt_step8", "ckpt_step10", ".ckpt_step12.tmp"):
        (out / name).mkdir()
        (out / name / ".metadata").write_text(name)
    return every_file(out)
