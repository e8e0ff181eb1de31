"""How a run that cannot start or cannot go on says so: one ``error:`` line, from rank 0 first.

Exit codes: 2 for bad input found before anything is built (flags, files, directories, the
environment, memory), 1 for a run that failed while running (a checkpoint, a reward function, a
non-finite policy, out of memory). Under torchrun the job's exit code is torchrun's (1), and
torchrun prints its own report of the failed workers after our line.
"""

from __future__ import annotations

import signal
import sys
import time
from types import CodeType

import torch

GRACE_S = 30.0
"""How long a rank other than 0 waits before printing an error of its own (``report_error``)."""

MEMORY_ADVICE = ("raise --grad-accum-steps or the number of ranks, lower --prompts-per-step, --group-size or "
                 "--max-new-tokens, or (a Hugging Face model) add --gradient-checkpointing or --parallel fsdp")


def report_error(message: str, rank: int) -> None:
    """Print ``error: message`` on stderr, rank 0 first.

    Under torchrun every rank finds the same bad input, and torchrun stops the whole job as soon
    as one worker exits: a rank that exited first could get rank 0 killed before it printed. So
    rank 0 prints and exits at once, and the others wait up to GRACE_S, with SIGTERM's default
    action restored so that torchrun's stop ends the wait, and print only if nobody stopped them:
    an error that rank 0 did not find, prefixed with their rank.
    """
    if rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(GRACE_S)
        message = f"rank {rank}: {message}"
    print(f"error: {message}", file=sys.stderr, flush=True)


def failed_step(err: BaseException, loop: CodeType) -> int | None:
    """The value of ``step`` in the frame running ``loop`` (train()'s code) when ``err`` was raised.

    Read from the traceback, so the training loop needs no bookkeeping for errors; None before
    the loop's first step (building, loading, the warm-up).
    """
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is loop:
            step = tb.tb_frame.f_locals.get("step")
            return step if isinstance(step, int) else None
        tb = tb.tb_next
    return None


def explain(err: BaseException, device: torch.device, step: int | None) -> str:
    """The message of an error that stopped a run at ``step`` (None: before the first step)."""
    where = "" if step is None else f"step {step}: "
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        return f"{where}out of memory on {device} ({first}); {MEMORY_ADVICE}; the checkpoints written so far are intact"
    return where + str(err)
