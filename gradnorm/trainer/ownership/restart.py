"""``--auto-resume``: one command line for the first start and every restart of a run.

An elastic restart (``torchrun --max-restarts``) or a Slurm requeue runs the same command again,
so the command cannot say whether this is the first start. ``resolve`` reads the output directory
and turns ``--auto-resume`` into what a person would have typed:

    output-dir holds                                      the start becomes
    nothing of a run                                      a fresh run
    a complete checkpoint of this run                     --resume (its checks: the flags that define
                                                          the run must equal config.json's)
    this run's files from before its first checkpoint     --overwrite: started over, the leftovers set
                                                          aside until the new first checkpoint
    a stranded --overwrite (previous_run/ holds the       --overwrite, with a warning that the old run
    run it replaced, output-dir no checkpoint) whose      in previous_run/ is deleted at this run's
    config.json is this run's                             first checkpoint
    the same, without a config.json of this run           refused, naming --resume (the old run put
                                                          back and continued) and --overwrite; but
                                                          previous_run/ of this run without a
                                                          checkpoint (an earlier start's files) and
                                                          no config.json in output-dir: started over
    this run, complete at --steps                         nothing: ``Complete``, exit 0 (naming the
                                                          export command if its export is unfinished)
    another run, or files without a config.json           refused in one line

Every refusal names a way out that works as typed: the same command with ``--resume`` or
``--overwrite`` in place of ``--auto-resume`` (beside it either is refused). Rank 0 alone resolves,
before anything is written, and the other ranks learn the outcome.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from gradnorm.trainer.checkpoint.store import latest_checkpoint
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.ownership import lock
from gradnorm.trainer.ownership.history import compare_resumed, read_config, unfinished_export


class Complete(Exception):
    """The run in output-dir already reached --steps: a restart has nothing to do (exit 0)."""


def resolve(cfg: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """``cfg`` with ``resume`` or ``overwrite`` set as the output directory requires (see the module).

    Raises ``Complete`` for a finished run and a one-line ValueError for another run's directory.
    """
    if not cfg.auto_resume:
        return cfg
    out = Path(cfg.output_dir)
    owner = lock.live_owner(out / lock.LOCK) if out.is_dir() else None
    if owner is not None:  # another run is writing it (an --overwrite in its warm-up looks stranded): not ours to read
        raise ValueError(lock.in_use(out, owner))
    if out.is_dir() and lock.stranded(out):
        return _stranded(cfg, out)
    checkpoint = latest_checkpoint(out) if out.is_dir() else None
    leftovers = lock.run_records(out) if out.is_dir() else []
    if checkpoint is None and not leftovers:
        return cfg  # the first start
    old = read_config(out)
    if old is None:
        names = ", ".join(p.name for p in (leftovers or [checkpoint])[:3])
        resume = "--resume in place of --auto-resume to continue it anyway, " if checkpoint is not None else ""
        raise ValueError(f"--auto-resume: --output-dir {out} holds files of a run ({names}) but no config.json to "
                         f"tell whether it is this run: rerun with {resume}--overwrite in place of --auto-resume to "
                         "replace it, or choose another --output-dir")
    resumed = dataclasses.replace(cfg, resume=True)
    # a run that died before its first checkpoint restarts from scratch, so its W does not matter
    compare_resumed(resumed, old, world_size if checkpoint is not None else None, by="--auto-resume")
    if checkpoint is None:
        return dataclasses.replace(cfg, overwrite=True)
    step = int(re.match(r"ckpt_step(\d+)", checkpoint.name).group(1))
    if step >= cfg.steps:  # exit 0 all the same: a requeue of a finished run must not fail
        raise Complete(f"--auto-resume: {out} is complete at step {step} (--steps {cfg.steps}): nothing to do"
                       f"{unfinished_export(cfg, checkpoint)}")
    return resumed


def _stranded(cfg: TrainConfig, out: Path) -> TrainConfig:
    """An --overwrite that stopped before its first checkpoint with no chance to put the old run back
    (a SIGKILL, an OOM kill): previous_run/ holds the old run, output-dir the replacement's leftovers.

    Starting over is what this command asks for only if the replacement is this run (its config.json
    matches the flags), and it costs the old run at the first checkpoint, so a line says so; else the
    command may be the old run's own (a requeue of its job), and only a person can tell: refused.
    One more case is this run's alone: an elastic restart killed before writing its config.json
    (loading the model) after setting aside this run's own files from an earlier start, which have
    no checkpoint (previous_run/config.json matches): nothing there to resume, so a restart goes on.
    """
    previous = out / lock.PREVIOUS
    kept = latest_checkpoint(previous)
    held = f"its latest checkpoint {kept.name}" if kept is not None else "no checkpoint"
    replacement = read_config(out)
    if replacement is None and kept is None and _differs(cfg, read_config(previous)) is None:
        print(f"warning: --auto-resume: {previous}/ holds this run's files from an earlier start that stopped before "
              f"its first checkpoint; this run starts over, and they are deleted at its first checkpoint",
              file=sys.stderr, flush=True)
        return dataclasses.replace(cfg, overwrite=True)
    why = _differs(cfg, replacement)
    if why is None:
        print(f"warning: --auto-resume: {out} holds this run's files from before its first checkpoint, and {previous}/ "
              f"the run an --overwrite replaced ({held}); this run starts over, and the old run in {previous}/ is "
              "deleted at this run's first checkpoint", file=sys.stderr, flush=True)
        return dataclasses.replace(cfg, overwrite=True)
    raise ValueError(f"--auto-resume: {previous}/ holds the run an --overwrite replaced ({held}), and the replacement "
                     f"stopped before its first checkpoint, {why}: rerun this command with --resume in place of "
                     "--auto-resume to put the old run back and continue it, or with --overwrite in place of "
                     f"--auto-resume to start the replacement over (the old run is deleted at its first checkpoint)")


def _differs(cfg: TrainConfig, config: dict | None) -> str | None:
    """None if ``config`` (a config.json) is this run's; else why not, for a refusal to quote."""
    if config is None:
        return "and left no config.json to tell whether it is this run"
    try:
        compare_resumed(dataclasses.replace(cfg, resume=True), config)
    except ValueError as err:  # its line without the "--resume: " it starts with and the advice after "; "
        return f"and it is not this run ({str(err).split(': ', 1)[1].split('; ')[0]})"
    return None
