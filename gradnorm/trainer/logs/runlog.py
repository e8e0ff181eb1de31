"""One object for everything a run records as it goes, so that the training loop holds the algorithm:
the phase times of each step, metrics.jsonl, the console, and the ``--report-to`` loggers.

The loop names its phases (``with log.phase("rollout"):``) and hands each step's record over
(``log.step(...)``); the rest is here:

- ``phase(name)`` charges the time since the previous phase ended to ``name``
  (``gradnorm.trainer.logs.phases``: nothing between two phases goes unaccounted);
- ``step(record, tokens)`` adds the step's timings (tokens per second, the run's clock, the phase
  times with their max over ranks: one tiny all-reduce, on every rank), then on rank 0 appends
  the line to metrics.jsonl, shows it and sends it to the loggers;
- ``sync()`` puts metrics.jsonl on disk before a checkpoint that covers its lines;
- leaving the ``with`` block closes everything: on success the summary and the learning curve, on
  any exception the loggers (W&B's files complete, its process ended) and nothing else.

Rank 0 alone writes; every other rank keeps the timer, because the max over ranks needs every rank.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from gradnorm.dist import comm
from gradnorm.trainer.checkpoint.checkpointer import RunState
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.logs import console, metrics
from gradnorm.trainer.logs.phases import PhaseTimer
from gradnorm.trainer.logs.reporters import Reporters


class RunLog:
    """The run's records: phase timer on every rank; metrics.jsonl, console and loggers on rank 0."""

    def __init__(self, cfg: TrainConfig, ctx: comm.DistContext, state: RunState, saved_record: dict | None = None):
        self.cfg, self.ctx, self.state, self.out = cfg, ctx, state, Path(cfg.output_dir)
        self.file = self.reporters = None
        if ctx.is_main:  # the directory is locked and an old run set aside by main
            self.file = metrics.open_run_files(self.out, cfg, ctx.world_size, state.step, state.warmup, saved_record)
            self.reporters = Reporters(cfg, self.out, ctx.world_size, state.step) if cfg.reporters else None
        self.bar = tqdm(total=cfg.steps, initial=state.step, disable=not (ctx.is_main and sys.stderr.isatty()),
                        desc="GRPO", dynamic_ncols=True)
        self.timer = PhaseTimer(ctx.device)  # laps between the loop's phases: where a step's time goes
        self._start = self._prev = self.timer.last
        self._elapsed0 = state.elapsed_s  # a resumed run continues the clock

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, kind, err, tb) -> None:
        self.bar.close()
        if not self.ctx.is_main:
            return
        if err is not None:  # a failed or stopped run: its loggers still finish
            if self.reporters is not None:
                self.reporters.close(exit_code=1)
            self.file.close()
            return
        comm.print0(f"last checkpoint written in {self.timer.peek('checkpoint'):.2f} s "
                    "(each line of metrics.jsonl has the one before it)")
        self.file.close()
        console.summarize(self.out, self.cfg.plot)
        if self.reporters is not None:
            self.reporters.close(figure=self.out / "learning_curve.png" if self.cfg.plot else None)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the time from the end of the previous phase to the end of this block to ``name``."""
        yield
        self.timer.lap(name)

    def step(self, record: dict, tokens: int) -> dict:
        """Complete a step's record with its timings, write and show it (rank 0); the run's clock moves on.

        The step ends at its last phase, so its phase times add up to its wall time; the max over
        ranks is one tiny all-reduce, which every rank makes.
        """
        now = self.timer.last
        record.update(tokens_per_second=tokens / max(now - self._prev, 1e-9),
                      elapsed_s=self._elapsed0 + now - self._start, **metrics.timing_fields(self.ctx.device))
        record.update(self.timer.split(comm.all_reduce_max))
        self._prev = now
        self.state.step, self.state.elapsed_s = record["step"], record["elapsed_s"]
        if self.ctx.is_main:
            metrics.write_record(self.file, self.bar, record, self.cfg)
            if self.reporters is not None:
                self.reporters.log(record)
        return record

    def sync(self) -> None:
        """metrics.jsonl on disk (rank 0): called before a checkpoint, so no checkpoint exists without its lines."""
        if self.ctx.is_main:
            metrics.sync(self.file)
