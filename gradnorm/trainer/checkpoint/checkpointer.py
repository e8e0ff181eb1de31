"""The checkpoints of a training run, and when to write them: its model, optimizer, reference and
counters (``RunState``), saved by every rank at once and loaded on any W and --parallel.

``Checkpointer.save(step, ...)`` is the one call the loop makes after every step; the policy lives
here: every ``--save-every`` steps, at the last step, and at a stop every rank agreed on (SIGTERM or
SIGINT), except the stop that abandons an ``--overwrite`` run at its first chance (below).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from gradnorm.dist import comm
from gradnorm.dist import state as dist_state
from gradnorm.trainer.checkpoint.store import checkpoint_dir, load, read_run_state, save
from gradnorm.trainer.config import TrainConfig


@dataclass
class RunState:
    """Where a run stands: what a checkpoint restores besides the weights, optimizer and RNGs."""

    step: int = 0
    """Optimizer steps done."""
    warmup: dict = field(default_factory=dict)
    """The warm-up's record (warmup.json)."""
    elapsed_s: float = 0.0
    """Seconds of GRPO before this process started (a resumed run continues the clock)."""
    skipped: int = 0
    """Steps skipped for a non-finite loss or gradient, in all."""
    in_a_row: int = 0
    """The same, in a row up to the last step."""

    def steps(self, last: int) -> Iterator[int]:
        """The steps still to run, ``step + 1 .. last``; ``in_flight`` names the one running."""
        for step in range(self.step + 1, last + 1):
            self._in_flight = step
            yield step

    @property
    def in_flight(self) -> int | None:
        """The optimizer step being run, or the last one once the loop is done (what a failure is
        reported at); None before the loop's first step (building, loading, the warm-up)."""
        return getattr(self, "_in_flight", None)


RUN_FIELDS = tuple(f.name for f in fields(RunState))


def save_checkpoint(out: Path, model, opt, ref, run: RunState, ctx: comm.DistContext, record: dict | None = None) -> None:
    """Write ckpt_step{N}/: every rank its own shards, in parallel, nothing gathered on one rank.

    ``record``, the step's line of metrics.jsonl, goes into trainer_state.json too: a resume whose
    metrics.jsonl lost that line (torn, or never reached the disk) restores it from there.
    """
    counters = asdict(run) if record is None else {**asdict(run), "record": record}
    save(out, run.step, dist_state.training_state(model, opt, ref), counters, ctx.rank)


def saved_record(path: Path | None) -> dict | None:
    """The metrics record a checkpoint holds of its own step (None: none, or an older checkpoint)."""
    if path is None:
        return None
    record = read_run_state(path, required=()).get("record")
    return record if isinstance(record, dict) else None


def load_checkpoint(path: Path, model, opt, ref, ctx: comm.DistContext) -> None:
    """Load a checkpoint written on any W and --parallel into this run's (possibly sharded) model."""
    state = dist_state.training_state(model, opt, ref)  # this run's layout: the placeholders to fill
    load(path, state, ctx.rank)
    dist_state.apply_training_state(model, opt, ref, state)


class Checkpointer:
    """When to checkpoint, and the checkpoint: the loop calls ``save`` after every step."""

    def __init__(self, cfg: TrainConfig, model, opt, ref, ctx: comm.DistContext):
        self.cfg, self.model, self.opt, self.ref, self.ctx = cfg, model, opt, ref, ctx
        self.out = Path(cfg.output_dir)

    def load(self, path: Path) -> None:
        """Weights, AdamW state, reference and RNGs, resharded to this W and --parallel."""
        load_checkpoint(path, self.model, self.opt, self.ref, self.ctx)

    def abandons(self, step: int, stop) -> bool:
        """A stop at the first chance of an --overwrite run (Ctrl-C right after an accidental
        --overwrite, during warm-up) writes no checkpoint: its first one would delete the old run,
        which main's RunDir puts back instead, also when that first chance is the run's last step.
        The same decision on every rank (the stop is agreed)."""
        return bool(stop) and self.cfg.overwrite and step == self.cfg.updates_per_rollout

    def due(self, step: int, stop) -> bool:
        every = self.cfg.save_every and step % self.cfg.save_every == 0
        return not self.abandons(step, stop) and bool(step == self.cfg.steps or every or stop)

    def save(self, run: RunState, stop=None, record: dict | None = None,
             before: Callable[[], None] = lambda: None) -> Path | None:
        """Checkpoint ``run.step`` if it is due; the directory written, or None.

        ``before`` runs first (the run log puts the lines a checkpoint covers on disk, so a crash
        tears neither); ``record``, the step's line, goes into the checkpoint too.
        """
        if not self.due(run.step, stop):
            return None
        before()
        save_checkpoint(self.out, self.model, self.opt, self.ref, run, self.ctx, record=record)
        return checkpoint_dir(self.out, run.step)
