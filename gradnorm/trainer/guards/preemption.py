"""Preemption: on SIGTERM or SIGINT every rank finishes its optimizer step, checkpoints and exits.

Clusters stop jobs with SIGTERM (SLURM, Kubernetes, and torchrun's agent, which forwards the
signal it gets to every worker), and people press Ctrl-C. Without this module either one would
lose every step since the last ``--save-every`` checkpoint, and Ctrl-C would print a traceback.

How a stop goes (the trainer uses this module in five lines):

 1. ``catch_signals()`` (around ``main()``) installs handlers for SIGTERM and SIGINT. The first
    signal only records a stop request; the step in flight goes on undisturbed, so no collective is
    ever cut in half and no rank is left waiting in one.
 2. At the end of every step each rank appends its request, ``votes(...)``, to the statistics
    that the trainer's logging all-reduce sums anyway (step 4): the ranks agree at no extra
    collective, even when only one of them got the signal. ``agreed(summed_votes)`` reads the
    sum, identical on every rank, so every rank takes the same decision.
 3. The trainer writes a checkpoint (atomically, with its ``save_checkpoint``) and raises
    ``Stopped``; ``main`` prints one line and exits with ``128 + signal``: **143 for SIGTERM, 130
    for SIGINT**, the shell's convention for "ended by this signal". A script can thus tell a run
    that stopped cleanly (continue it with ``--resume``) from one that finished (0) or failed (1, 2).
 4. A second signal exits at once, with the same code, one line and no checkpoint: the way out of a
    step that hangs. A copy of the first signal that arrives within ``DUPLICATE_S`` of it counts as
    the same request, because one stop can reach a worker twice (SLURM signals every process of a
    job while torchrun forwards the same signal to its workers).
 5. Before training starts (``exit_at_once``, around the start: the flags, the rendezvous, each
    rank's checks and rank 0's decision about output-dir) there is no step to finish: the first
    signal ends the process at once, with one line and the same exit code.

The second signal is acted on by a watcher thread that reads the signal wakeup fd: CPython runs a
Python-level handler only when the main thread executes bytecode, which it does not while it
waits inside a collective on a dead peer. The thread sees every signal as soon as it arrives."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a run; ``votes`` has one entry per signal, in this order."""

DUPLICATE_S = 1.0
"""A repeat of the first signal within this many seconds is the same stop request, not a second one."""


class Stopped(Exception):
    """Raised by the trainer after the checkpoint of the step at which the ranks agreed to stop."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signal.Signals(signum), step, checkpoint
        if checkpoint is None:  # the first step of an --overwrite run: nothing of it is kept
            super().__init__(f"stopped by {self.signum.name} after step {step}, the first of this --overwrite run: "
                             "no checkpoint written, so the run it replaced is kept (put back in --output-dir)")
            return
        super().__init__(f"stopped by {self.signum.name} after step {step}: checkpoint {checkpoint} written; "
                         "continue with --resume")

    @property
    def exit_code(self) -> int:
        """128 + the signal number: 143 for SIGTERM, 130 for SIGINT."""
        return 128 + int(self.signum)


class _Requests:
    """What this process has received; written by the watcher thread, read by the main thread."""

    def __init__(self):
        self.first: signal.Signals | None = None
        self.first_at = 0.0
        self.at_once = False  # inside ``exit_at_once``: a signal ends the process, there is no step to finish

    def receive(self, signum: signal.Signals) -> None:
        now = time.monotonic()
        if self.at_once:  # nothing trained, nothing to checkpoint: a wait in a rendezvous or for rank 0 ends now
            _say(f"received {signum.name} before training started: exiting now (exit code {128 + signum}); "
                 "nothing was trained", rank0_only=True)
            os._exit(128 + int(signum))
        if self.first is None:
            self.first, self.first_at = signum, now
            _say(f"received {signum.name}: finishing this step, then checkpoint and exit "
                 f"(send it again to exit at once, without a checkpoint)", rank0_only=True)
        elif now - self.first_at > DUPLICATE_S:
            _say(f"received {signum.name} again: exiting at once, without a checkpoint (exit code {128 + signum})")
            os._exit(128 + int(signum))


_requests = _Requests()


def _say(message: str, rank0_only: bool = False) -> None:
    # os.write, not print: this runs on the watcher thread while the main thread may be printing.
    rank = os.environ.get("RANK", "0")
    if rank0_only and rank != "0":
        return
    prefix = f"rank {rank}: " if "RANK" in os.environ and rank != "0" else ""
    os.write(2, f"{prefix}{message}\n".encode())


def _watch(read_fd: int) -> None:
    while data := os.read(read_fd, 64):  # b"" once catch_signals closes the write end
        for signum in data:
            if signum in SIGNALS:
                _requests.receive(signal.Signals(signum))


def _noted(signum, frame) -> None:
    """The Python-level handler: nothing to do, the watcher thread has already seen the signal."""


@contextmanager
def catch_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT request a stop instead of ending the process.

    Restores the previous handlers (and forgets any request) on the way out. Outside the main
    thread, where Python cannot install handlers, it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C-level handler must never block on a full pipe
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    previous = {signum: signal.signal(signum, _noted) for signum in SIGNALS}
    watcher = threading.Thread(target=_watch, args=(read_fd,), name="gradnorm-preemption", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)
        watcher.join(timeout=5)
        os.close(read_fd)
        _requests.__init__()


@contextmanager
def exit_at_once() -> Iterator[None]:
    """Within the block a signal ends the process at once (exit 128 + its number, one line), though
    ``catch_signals`` is in force: the trainer's start, before any step exists to finish.

    There a process reads its flags, waits for its peers in the rendezvous, checks its inputs and
    waits for rank 0's decision about output-dir, which rank 0 takes: every file it moves is
    journalled, so a kill there is undone by the next start (``ownership.lock.settle``). Deferring
    the signal to the end of a step that does not exist would only hold torchrun's SIGTERM until its
    SIGKILL, 30 s later.
    """
    _requests.at_once = True
    try:
        yield
    finally:
        _requests.at_once = False


def requested() -> signal.Signals | None:
    """The first stop signal this process received inside ``catch_signals``, if any."""
    return _requests.first


def votes(like: Tensor) -> Tensor:
    """This rank's stop votes (len(SIGNALS),), float64 on ``like``'s device: 1 for the signal received."""
    return torch.tensor([float(_requests.first == s) for s in SIGNALS], dtype=torch.float64, device=like.device)


def agreed(summed_votes: Tensor) -> signal.Signals | None:
    """The signal every rank stops for, from the votes summed over ranks; None to go on.

    SIGTERM wins over SIGINT when ranks got different ones (a scheduler's stop is not negotiable).
    """
    for signum, count in reversed(list(zip(SIGNALS, summed_votes.tolist()))):
        if count > 0:
            return signum
    return None
