"""One run of gradnorm/train.py, from its command line to its exit code: ``Session``.

``main()`` reads the config, checks it and trains. What surrounds that is here, behind one context
manager: the checks every rank makes before any model exists, rank 0's hold on output-dir (the
lock, and the run directory closed as succeeded or not), the process group (torn down after a
failure is reported, since reporting one posts it to the peers), and the failure ladder: each kind
of failure handled once, with its one ``error:`` line (``guards.failures``) and its exit code.

    kind of failure               what raises it                                        exit code
    a finished run, requeued      ``restart.Complete`` (--auto-resume)                  0
    a stop                        ``preemption.Stopped`` (SIGTERM, SIGINT)              143, 130
    bad input                     a ValueError before the process group exists,         2
                                  or ``failures.InputError`` (found with the model)
    output-dir takes no files     an OSError before the process group exists            1
    no process group              ``comm.setup`` (address, port, a peer never came)     1
    a failed run                  while training: a ValueError, ``TrainingError``,      1, posted to
                                  ``CheckpointError``, an OSError, out of memory          the peers
    a failed peer                 a collective's RuntimeError while training            1

Anything else is a bug, and its traceback is the report.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from gradnorm.core.errors import first_line
from gradnorm.dist import comm
from gradnorm.trainer.checkpoint import store
from gradnorm.trainer.checkpoint.checkpointer import RunState
from gradnorm.trainer.config import TrainConfig, parse_config
from gradnorm.trainer.guards import failures, launch, memory, preemption, preflight
from gradnorm.trainer.ownership import history, lock, restart


class _NoProcessGroup(Exception):
    """``comm.setup`` failed; its first line."""


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

    def check(self, cfg: TrainConfig) -> tuple[TrainConfig, Path | None]:
        """(the config to run, the checkpoint to resume from): every rank checks the same flags, files
        and environment before any model exists; then rank 0 alone opens and locks output-dir."""
        rank, world_size = self.rank, self.world_size
        lock.settle(Path(cfg.output_dir), rank)  # a kill mid-move of a run: make it whole before anyone reads it
        cfg = self._cfg = restart.resolve(cfg, world_size)
        preflight.check_inputs(cfg)
        lock.check(Path(cfg.output_dir), cfg.resume, cfg.overwrite, rank)
        ckpt_path = history.resume_point(cfg, world_size)
        memory.check_fits(cfg, world_size, launch.device_of(cfg), sharing=launch.local_ranks())
        if rank == 0:  # rank 0 alone writes output-dir
            self._run_dir = lock.RunDir(cfg.output_dir)
            self._run_dir.open(cfg.resume, cfg.overwrite)
        return cfg, ckpt_path

    def join(self, cfg: TrainConfig) -> comm.DistContext:
        """The process group (none for one plain process), torn down when the session ends."""
        torch.set_num_threads(cfg.cpu_threads)
        try:
            self._ctx = comm.setup(backend=None if cfg.backend == "auto" else cfg.backend,
                                   device=None if cfg.device == "auto" else cfg.device, timeout_s=cfg.timeout_s)
        except (RuntimeError, ValueError) as err:  # the rendezvous failed (address, port, a peer that never came)
            raise _NoProcessGroup(first_line(err)) from err
        return self._ctx

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
        if isinstance(err, restart.Complete):  # --auto-resume of a finished run: a requeue has nothing to do
            if rank == 0:
                print(err, file=sys.stderr, flush=True)
            return 0
        if isinstance(err, preemption.Stopped):  # SIGTERM or SIGINT: checkpointed, one line, 143 or 130
            if rank == 0:
                print(err, file=sys.stderr, flush=True)
            return err.exit_code
        if isinstance(err, failures.InputError) or (isinstance(err, ValueError) and not joined):  # bad input
            failures.report_error(str(err), 0 if isinstance(err, launch.NoLauncher) else rank)
            return 2
        if isinstance(err, OSError) and not joined:  # output-dir takes no more files (a full disk) as the run's first are written
            where = err.filename or (self._cfg.output_dir if self._cfg is not None else "output-dir")
            failures.report_error(f"could not write {where} ({err.strerror or err}); nothing was trained: free "
                                  "space there, or choose another --output-dir", rank)
            return 1
        if isinstance(err, _NoProcessGroup):
            failures.report_error(f"could not join the process group ({err})", rank)
            return 1
        if not joined:
            return None
        ctx = self._ctx
        if isinstance(err, (ValueError, failures.TrainingError, store.CheckpointError, OSError)) or \
                failures.out_of_memory(err):  # a bad checkpoint, a full disk, a bad reward, NaN after NaN, out of memory
            step = None if isinstance(err, failures.TrainingError) else self.run.in_flight  # a TrainingError names its step
            message = failures.explain(err, ctx.device, step)
            comm.post_error(message)  # ranks waiting for this one in a collective learn it now, not after --timeout-s
            failures.report_error(message, ctx.rank)
            return 1
        if isinstance(err, RuntimeError) and comm.is_collective_failure(err):  # a peer failed (and said why), died, or hangs
            failures.report_error(failures.peer_failure(comm.posted_errors(ctx.world_size), err, ctx.rank,
                                                        ctx.world_size, self._cfg.timeout_s, self.run.in_flight),
                                  ctx.rank)
            return 1
        return None
