"""How a run that cannot start or cannot go on says so: one ``error:`` line, from rank 0 first.

Exit codes: 2 for bad input found before anything is built (flags, files, directories, the
environment, memory), 1 for a run that failed while running (a checkpoint, a reward function, a
non-finite policy, out of memory). Under torchrun the job's exit code is torchrun's (1), and
torchrun prints its own report of the failed workers after our line."""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import time

import torch

from gradnorm.core.errors import first_line  # also what main() reports a failed join with
from gradnorm.trainer.checkpoint.store import latest_checkpoint
from gradnorm.trainer.config import TrainConfig

GRACE_S = 30.0
"""How long a rank other than 0 waits before printing an error of its own (``report_error``)."""


MEMORY_ADVICE = ("raise --grad-accum-steps or the number of ranks, lower --prompts-per-step, --group-size or "
                 "--max-new-tokens, or (a Hugging Face model) add --gradient-checkpointing or --parallel fsdp")


class InputError(ValueError):
    """Bad input found only once the model or its tokenizer is loaded (the prompt length a budget must
    hold, a model that cannot take packed rows): reported like a preflight error, exit code 2."""


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. too many non-finite steps in a row); reported in one line, exit code 1."""


def report_error(message: str, rank: int) -> None:
    """Print ``error: message`` on stderr, rank 0 first.

    Under torchrun every rank finds the same bad input, and torchrun stops the whole job as soon
    as one worker exits: a rank that exited first could get rank 0 killed before it printed. So
    rank 0 prints and exits at once, and the others wait up to GRACE_S, with SIGTERM's default
    action restored so that torchrun's stop ends the wait, and print only if nobody stopped them:
    an error that rank 0 did not find, prefixed with their rank. On several nodes the first rank
    of each node (LOCAL_RANK 0) prints at once too, so every node's log says why it stopped.
    """
    if rank != 0:
        if os.environ.get("LOCAL_RANK") != "0":  # not the first rank of its node
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(GRACE_S)
        message = f"rank {rank}: {message}"
    print(f"error: {message}", file=sys.stderr, flush=True)


def out_of_memory(err: BaseException) -> bool:
    """CUDA's or Python's out-of-memory error, or torch's CPU allocator failing (a plain RuntimeError)."""
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(err))


WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)
"""What a write that names no file fails with: a full disk or quota, a read-only or failing device."""


def explain(err: BaseException, device: torch.device, step: int | None, cfg: TrainConfig | None = None) -> str:
    """The message of an error that stopped the run ``cfg`` (None: unknown) at ``step`` (None: before
    the first step); the checkpoints in its output directory decide how it can go on."""
    where = "" if step is None else f"step {step}: "
    if out_of_memory(err):  # no --resume advice: MEMORY_ADVICE's smaller batch is another run
        first = first_line(err, 160)
        return f"{where}out of memory on {device} ({first}); {MEMORY_ADVICE}; {_what_is_left(cfg)}"
    if isinstance(err, OSError) and (err.filename is not None or err.errno in WRITE_ERRNOS):  # a run file
        what = err.filename if err.filename is not None else "a file of the run"  # metrics.jsonl, config.json, ...
        return (f"{where}could not write {what} ({err.strerror or err}); "
                f"{_what_is_left(cfg, ', and --resume continues from the latest once the cause is fixed')}")
    return where + str(err)


def _what_is_left(cfg: TrainConfig | None, resume: str = "") -> str:
    """What the failed run left to go on from: its checkpoints (then ``resume``, the way on), or
    none (--save-every 0, or a failure before the first save), and then the only way on is to start
    over: the same command under --auto-resume (which starts over by itself), else with --overwrite
    (a plain start refuses a directory that holds a run)."""
    if cfg is None:  # a caller that cannot say where the run is: what holds either way
        return f"any checkpoint written so far is intact{resume}"
    if latest_checkpoint(cfg.output_dir) is None:
        again = "the same command again" if cfg.auto_resume else "the same command with --overwrite"  # --resume had one
        return f"no checkpoint was written, so there is nothing to resume: start the run over ({again})"
    return f"the checkpoints written so far are intact{resume}"


def peer_failure(posted: dict[int, str], err: BaseException, rank: int, world_size: int, timeout_s: float,
                 step: int | None) -> str:
    """The message of a collective that failed on this rank because of a peer.

    ``posted`` holds the errors failing ranks left (``comm.post_error``): the lowest other rank's
    is the cause. Without one the peer died (SIGKILL, a crash in C++) or hangs: say which rank
    when W = 2, and how long it was waited for.
    """
    others = {r: message for r, message in posted.items() if r != rank}
    if others:
        first = min(others)
        return f"rank {first}: {others[first]}"
    where = "" if step is None else f"step {step}: "
    who = f"rank {1 - rank}" if world_size == 2 else "another rank"
    text = first_line(err, 300)
    why = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]  # gloo's source location and advice out
    if "Timed out" in text or "timed out" in text.lower():
        return (f"{where}{who} stopped responding after {timeout_s:g} s (--timeout-s) in a collective ({why}); its "
                "own output says why, or it hangs; raise --timeout-s if one of its steps may take that long")
    return f"{where}{who} died or left the process group ({why}); its own output, or the launcher's, says why"
