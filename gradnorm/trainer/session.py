"""One run of gradnorm/train.py, from its command line to its exit code: ``Session``.

``main()`` reads the config, joins the process group, checks and trains. What surrounds that is
here, behind one context manager: the start every rank agrees on before any model exists (each
rank's checks, then rank 0's decision about output-dir, which the others learn rather than read for
themselves), rank 0's hold on output-dir (the lock, and the run directory closed as succeeded or
not), the process group (torn down after a failure is reported, since reporting one posts it to the
peers), and the failure ladder: each kind of failure handled once, with its one ``error:`` line
(``guards.failures``) and its exit code.

    kind of failure               what raises it                                        exit code
    a finished run, requeued      ``restart.Complete`` (--auto-resume), on rank 0       0
    a stop                        ``preemption.Stopped`` (SIGTERM, SIGINT)              143, 130
    bad input                     a ValueError while reading the flags; any rank's      2
                                  check, or rank 0's decision, which every rank
                                  learns; ``failures.InputError`` (found with the model)
    output-dir takes no files     an OSError of rank 0's decision (a full disk), or     1
                                  ``lock.MoveFailed`` (the old run could not be set aside)
    no process group              ``comm.setup`` (address, port, a peer never came)     1
    a failed run                  while training: a ValueError, ``TrainingError``,      1, posted to
                                  ``CheckpointError``, an OSError, out of memory          the peers
    a failed peer                 a collective's RuntimeError while training            1

A signal before training starts ends the process at once (``preemption.exit_at_once``).

Anything else is a bug, and its traceback is the report.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from gradnorm.core.errors import first_line
from gradnorm.dist import comm
from gradnorm.trainer.checkpoint import store
from gradnorm.trainer.checkpoint.checkpointer import RunState
from gradnorm.trainer.config import TrainConfig, parse_config
from gradnorm.trainer.guards import failures, launch, memory, preemption, preflight
from gradnorm.trainer.ownership import history, lock, restart


WAIT_NOTICE_S = 3.0
"""A join of the process group still waiting after this long says what it waits for (one host joins in
well under a second)."""


class _NoProcessGroup(Exception):
    """``comm.setup`` failed; its first line."""


@dataclasses.dataclass(frozen=True)
class _Decision:
    """What rank 0 made of output-dir, for every rank: the start's --resume and --overwrite (as
    --auto-resume resolved them) and the checkpoint it continues from."""

    resume: bool
    overwrite: bool
    checkpoint: Path | None


class _Refused(Exception):
    """The start ends before training, on every rank alike: ``code`` (0 for a finished run's requeue,
    2 for bad input, 1 for a failed write), the line of the rank that found it (``origin``), and
    ``own``: this rank's own line, when its own check failed too (a flag that differs between nodes
    fails on every rank, each with its own digest)."""

    def __init__(self, code: int, origin: int, message: str, own: str | None = None):
        super().__init__(message)
        self.code, self.origin, self.message, self.own = code, origin, message, own

    def __reduce__(self):  # broadcast from rank 0 as a decision
        return _Refused, (self.code, self.origin, self.message)

    def report(self, rank: int) -> None:
        """Rank 0 prints the line at once, and so does the first rank of each other node, so that
        every node's log says why it stopped: its own line if its check failed, else whose it stops
        with. Every other rank already knows, and waits for torchrun's stop so that it cannot end the
        job before rank 0 has printed (as ``failures.report_error``). A finished run's requeue is
        rank 0's line alone."""
        if rank == 0:
            said = self.message if self.origin == 0 else f"rank {self.origin}: {self.message}"
            print(said if self.code == 0 else f"error: {said}", file=sys.stderr, flush=True)
        elif self.code != 0 and os.environ.get("LOCAL_RANK") == "0":
            said = self.own or (self.message if self.origin == 0 else
                                f"stopping with rank {self.origin}: {self.message}")
            print(f"error: rank {rank}: {said}", file=sys.stderr, flush=True)
        elif self.code != 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(failures.GRACE_S)


def _waiting(rank: int, world_size: int, timeout_s: float) -> None:
    """The line of a join that is slow to complete (a timer thread prints it, so the wait goes on)."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    prefix = f"rank {rank}: " if rank != 0 else ""
    print(f"{prefix}waiting for all {world_size} ranks to join at {where} (RANK={rank} WORLD_SIZE={world_size} from "
          f"the environment), for up to --timeout-s {timeout_s:g} s; if no other rank is starting, these variables "
          "are a leftover of another launch: stop this (Ctrl-C), unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT and "
          "run one process, or launch with torchrun or srun", file=sys.stderr, flush=True)


class Session:
    """``with Session() as session``: read the config, check it, join, train; then ``session.exit_code``.

    ``session.run`` holds the run's counters: a failure is reported at ``run.in_flight``.
    """

    def __init__(self) -> None:
        self.rank, self.world_size = launch.error_rank(), 1
        self.run = RunState()
        self.exit_code = 0
        self._cfg: TrainConfig | None = None
        self._run_dir: lock.RunDir | None = None
        self._ctx: comm.DistContext | None = None

    def __enter__(self) -> Session:
        return self

    def read_config(self, argv: list[str] | None) -> TrainConfig:
        """The flags, as every rank of this launch reads them."""
        self.rank, self.world_size = launch.launch_environment()
        self._cfg = parse_config(argv, self.world_size, prog="gradnorm/train.py")
        return self._cfg

    def join(self, cfg: TrainConfig) -> comm.DistContext:
        """The process group (none for one plain process), torn down when the session ends.

        Every rank joins before any rank checks anything, so that the ranks can agree on their checks
        and learn rank 0's decision about output-dir (``check``). A join that has not completed
        within ``WAIT_NOTICE_S`` says what it waits for: a launch whose peers never come (a stale
        environment) would otherwise wait ``--timeout-s`` in silence.
        """
        torch.set_num_threads(cfg.cpu_threads)
        notice = threading.Timer(WAIT_NOTICE_S, _waiting, args=(self.rank, self.world_size, cfg.timeout_s))
        notice.daemon = True
        notice.start()
        try:
            self._ctx = comm.setup(backend=None if cfg.backend == "auto" else cfg.backend,
                                   device=None if cfg.device == "auto" else cfg.device, timeout_s=cfg.timeout_s)
        except (RuntimeError, ValueError) as err:  # the rendezvous failed (address, port, a peer that never came)
            raise _NoProcessGroup(first_line(err)) from err
        finally:
            notice.cancel()
        return self._ctx

    def check(self, cfg: TrainConfig) -> tuple[TrainConfig, Path | None]:
        """(the config to run, the checkpoint to resume from), the same on every rank.

        Every rank checks what it alone can see (its flags against the others', the files the flags
        name on its node, its memory), and the ranks agree: one failing rank fails them all, with its
        line, before anything is written. Then rank 0 alone reads output-dir, takes the lock and
        decides (``_decide``), and every other rank learns the decision: no two ranks look at the
        directory at different moments of its start (one could see files the other had moved).
        """
        local = None
        try:
            launch.check_same_command(cfg)  # a collective: every rank gets the same answer
            preflight.check_inputs(cfg)
            memory.check_fits(cfg, self.world_size, launch.device_of(cfg), sharing=launch.local_ranks())
        except ValueError as err:
            local = str(err)
        failed = comm.first_failure(local)
        if failed is not None:
            raise _Refused(2, *failed, own=local)
        decided = comm.broadcast_object(self._decide(cfg) if self.rank == 0 else None)
        if isinstance(decided, _Refused):
            raise decided
        cfg = self._cfg = dataclasses.replace(cfg, resume=decided.resume, overwrite=decided.overwrite)
        return cfg, decided.checkpoint

    def _decide(self, cfg: TrainConfig) -> _Decision | _Refused:
        """Rank 0's decision about output-dir, or the refusal every rank exits with: finish a move a
        kill interrupted, resolve --auto-resume, check, take the lock and set an old run aside (or
        put it back), and find the checkpoint to resume from."""
        out = Path(cfg.output_dir)
        try:
            lock.settle(out)  # a kill mid-move of a run: make it whole before reading it
            cfg = restart.resolve(cfg, self.world_size)
            lock.check(out, cfg.resume, cfg.overwrite)
            restoring = cfg.resume and lock.stranded(out)  # --resume puts the old run back first, then continues it
            checkpoint = None if restoring else history.resume_point(cfg, self.world_size)  # bad input: untouched
            self._run_dir = lock.RunDir(out)
            self._run_dir.open(cfg.resume, cfg.overwrite)
            if restoring:
                checkpoint = history.resume_point(cfg, self.world_size)
            return _Decision(cfg.resume, cfg.overwrite, checkpoint)
        except restart.Complete as done:  # a requeue of a finished run: nothing to do, exit 0
            return _Refused(0, 0, str(done))
        except lock.MoveFailed as err:  # the old run could not be set aside: the move is undone, nothing trained
            return _Refused(1, 0, str(err))
        except ValueError as err:
            return _Refused(2, 0, str(err))
        except OSError as err:  # output-dir takes no more files (a full disk) as the run's first are written
            return _Refused(1, 0, f"could not write {err.filename or out} ({err.strerror or err}); nothing was "
                                  "trained: free space there, or choose another --output-dir")

    def __exit__(self, kind, err, tb) -> bool:
        try:
            code = None if err is None else self._report(err)
        finally:
            if self._ctx is not None:
                comm.teardown()
            if self._run_dir is not None:
                self._run_dir.close(succeeded=err is None)
        if code is None:  # success (0), or an error that is a bug: its traceback
            return False
        self.exit_code = code
        return True

    def _report(self, err: BaseException) -> int | None:
        """Print the one line of a failure; its exit code, or None for an error no rung expects."""
        joined, rank = self._ctx is not None, self.rank
        if isinstance(err, _Refused):  # the start ends before training, every rank agreed how (``check``)
            err.report(rank)
            return err.code
        if isinstance(err, preemption.Stopped):  # SIGTERM or SIGINT: checkpointed, one line, 143 or 130
            if rank == 0:
                print(err, file=sys.stderr, flush=True)
            return err.exit_code
        if isinstance(err, failures.InputError) or (isinstance(err, ValueError) and not joined):  # bad input
            failures.report_error(str(err), 0 if isinstance(err, launch.NoLauncher) else rank)
            return 2
        if isinstance(err, _NoProcessGroup):
            failures.report_error(f"could not join the process group ({err})", rank)
            return 1
        if not joined:
            return None
        ctx = self._ctx
        if isinstance(err, (ValueError, failures.TrainingError, store.CheckpointError, OSError)) or \
                failures.out_of_memory(err):  # a bad checkpoint, a full disk, a bad reward, NaN after NaN, out of memory
            step = None if isinstance(err, failures.TrainingError) else self.run.in_flight  # a TrainingError names its step
            message = failures.explain(err, ctx.device, step, self._cfg)
            comm.post_error(message)  # ranks waiting for this one in a collective learn it now, not after --timeout-s
            failures.report_error(message, ctx.rank)
            return 1
        if isinstance(err, RuntimeError) and comm.is_collective_failure(err):  # a peer failed (and said why), died, or hangs
            failures.report_error(failures.peer_failure(comm.posted_errors(ctx.world_size), err, ctx.rank,
                                                        ctx.world_size, self._cfg.timeout_s, self.run.in_flight),
                                  ctx.rank)
            return 1
        return None
