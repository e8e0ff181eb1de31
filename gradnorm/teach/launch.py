"""Launching the real trainer: ``torchrun gradnorm/train.py`` as a subprocess, its metrics read back.

``torchrun_command`` builds the one command line (``python -m torch.distributed.run``, so the
torchrun of the running interpreter); ``train_run`` runs it and reads the run with
``gradnorm.teach.runs.load_run`` (notebook 03).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gradnorm.teach.runs import TrainingRun, load_run

TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "train.py"


def torchrun_command(nproc_per_node: int, *train_args: str, script: str | Path = TRAIN_SCRIPT) -> list[str]:
    """argv of ``torchrun --standalone --nproc_per_node=N script *train_args`` for the running interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}",
            str(script), *train_args]


def train_run(
    output_dir: str | Path,
    loss_denominator: str = "token",
    shard: str = "length",
    grad_accum_steps: int = 2,
    nproc_per_node: int = 2,
    steps: int = 30,
    seed: int = 0,
    extra_args: Sequence[str] = ("--no-plot", "--save-every", "0"),
    label: str | None = None,
    timeout_s: float = 1800,
) -> TrainingRun:
    """Run ``torchrun --standalone --nproc_per_node=W gradnorm/train.py`` with these flags and read its metrics.

    Each process runs with OMP_NUM_THREADS=1 (the trainer's processes share the cores). The run
    writes into ``output_dir``; a failure raises with the tail of the trainer's output.
    """
    output_dir = Path(output_dir)
    cmd = torchrun_command(
        nproc_per_node, "--loss-denominator", str(loss_denominator), "--shard", shard,
        "--grad-accum-steps", str(grad_accum_steps), "--steps", str(steps), "--seed", str(seed),
        "--output-dir", str(output_dir), "--overwrite", *extra_args,  # a rerun replaces its own run
    )
    start = time.perf_counter()
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"the trainer failed (exit {done.returncode}): {' '.join(cmd)}\n{tail}")
    return load_run(output_dir, label, wall_s=time.perf_counter() - start)
