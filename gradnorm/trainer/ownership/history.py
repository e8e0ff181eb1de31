"""config.json and ``--resume``: the flags that define a run, every start of it, and where it resumes.

config.json keeps the latest values at the top level and every start in ``history``; a resume
compares the flags that define the run with it (``compare_resumed``) and continues from the latest
complete checkpoint (``resume_point``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from fractions import Fraction
from pathlib import Path

from gradnorm.core.denominators import parse_denominator
from gradnorm.trainer.checkpoint.store import latest_checkpoint
from gradnorm.trainer.config import TrainConfig, changeable_on_resume
from gradnorm.trainer.guards import outpaths
from gradnorm.trainer.ownership.lock import now


def read_config(out: Path) -> dict | None:
    """config.json of the run in ``out``, or None when there is none (a bare checkpoint)."""
    path = out / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is unreadable ({err}); restore it, or delete it to resume without "
                         "comparing the flags") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object; restore it, or delete it to resume without comparing the flags")
    return config


PATH_FLAGS = ("model", "prompts", "output_dir", "export_hf")
"""Flags that name a file or directory: the same one by another path is no change."""


def _same(name: str, old, new) -> bool:
    """Whether a flag's old and new values mean the same: files by what they resolve to (``./p.jsonl``
    and its absolute path), numbers by value (``1e3`` and ``1000`` as --loss-denominator)."""
    if old == new:
        return True
    if name in PATH_FLAGS and isinstance(old, str) and isinstance(new, str):
        try:
            return os.path.samefile(old, new) or os.path.realpath(old) == os.path.realpath(new)
        except (OSError, ValueError):  # one of them is not there (a Hub id, a moved file): compare the paths
            return os.path.realpath(old) == os.path.realpath(new)
    if name == "loss_denominator":
        try:
            return parse_denominator(old) == parse_denominator(new)
        except ValueError:
            return False
    numbers = (any(isinstance(v, (int, float)) for v in (old, new))
               and all(isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in (old, new)))
    try:  # exact: two large seeds one apart are two seeds, though equal as floats
        return numbers and Fraction(old) == Fraction(new)
    except (ValueError, ZeroDivisionError, OverflowError):
        return False


def prompts_digest(cfg: TrainConfig) -> str | None:
    """sha256 of the --prompts file's bytes (None: the built-in task, or no such file): the path alone
    does not say what a run trained on, since a file can be regenerated in place."""
    if cfg.prompts is None or not Path(cfg.prompts).is_file():
        return None
    return hashlib.sha256(Path(cfg.prompts).read_bytes()).hexdigest()


def changed_flags(cfg: TrainConfig, old: dict) -> dict[str, list]:
    """{field: [old value, new value]} for every flag that differs from the old run's config.json."""
    new = cfg.to_dict()
    return {name: [old[name], value] for name, value in new.items()
            if name in old and not _same(name, old[name], value) and name not in ("resume", "overwrite")}  # how, not what


def compare_resumed(cfg: TrainConfig, old: dict | None, world_size: int | None = None, by: str = "--resume") -> None:
    """A one-line ValueError naming every flag that defines the run and differs from ``old``.

    Under ``local`` the number of ranks defines the run too: its weights are 1 / (W A N[r, m]), so
    a resume on another W trains on another objective, as another --grad-accum-steps would (every
    other denominator is invariant to W: that is the point). ``world_size`` is this start's W;
    ``old["world_size"]`` the latest start's. ``by``: the flag that asked for the resume, which the
    line starts with and which its advice replaces (--overwrite beside it is refused).
    """
    if old is None:
        return
    new_run = f"start a new run (another --output-dir, or --overwrite in place of {by})"
    denominator = old.get("loss_denominator", cfg.loss_denominator)
    before = old.get("world_size")
    if denominator == "local" and world_size is not None and isinstance(before, int) and before != world_size:
        raise ValueError(f"{by}: {cfg.output_dir} trained with --loss-denominator local on {before} "
                         f"rank{'s' if before != 1 else ''}, and this start has {world_size}; under local the "
                         f"number of ranks changes the update, so resume it on the same number of ranks, or {new_run}")
    fixed = {name: pair for name, pair in changed_flags(cfg, old).items()
             if not changeable_on_resume(name, denominator)}
    digest = prompts_digest(cfg)
    if old.get("prompts_sha256") and digest and digest != old["prompts_sha256"] and "prompts" not in fixed:
        raise ValueError(f"{by}: --prompts {cfg.prompts} is not the file this run trained on (its contents changed "
                         f"since: sha256 {old['prompts_sha256'][:12]}... -> {digest[:12]}...); resume with the run's "
                         f"file, or {new_run}")
    if fixed:
        listed = ", ".join(f"--{name.replace('_', '-')} {old_value} -> {new_value}"
                           for name, (old_value, new_value) in fixed.items())
        raise ValueError(f"{by}: the flags that define the run differ from {cfg.output_dir}/config.json: {listed}; "
                         f"resume with the run's values, or {new_run}")


def write_config(out: Path, cfg: TrainConfig, world_size: int, step: int) -> None:
    """config.json: every flag of the run as of now, and ``history`` with one entry per start."""
    old = read_config(out) if cfg.resume else None
    entry = {"started": now(), "step": step, "world_size": world_size}
    if cfg.resume:
        entry["changed"] = {} if old is None else changed_flags(cfg, old)
        if old is None:
            entry["note"] = "resumed without a config.json: flags not compared"
    history = (old or {}).get("history", [])
    config = {**cfg.to_dict(), "world_size": world_size, "prompts_sha256": prompts_digest(cfg),
              "history": [*history, entry]}
    tmp = out / ".config.json.tmp"
    try:
        tmp.write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmp, out / "config.json")  # a crash mid-write leaves the old config.json
    except OSError:  # a full disk: no empty temporary file is left beside the old config.json
        tmp.unlink(missing_ok=True)
        raise


def resume_point(cfg: TrainConfig, world_size: int | None = None) -> Path | None:
    """The checkpoint --resume continues from, once the run it continues is known to match.

    One-line ValueErrors: no checkpoint; a flag that defines the run differs from config.json, or
    a ``local`` run's number of ranks (``compare_resumed``); --steps not beyond the checkpoint's step.
    """
    if not cfg.resume:
        return None
    path = latest_checkpoint(cfg.output_dir)
    if path is None:
        old = " (its ckpt_step*.pt files are the single-file format of earlier versions)" \
            if any(Path(cfg.output_dir).glob("ckpt_step*.pt")) else ""
        raise ValueError(f"--resume: no complete checkpoint ckpt_step*/ in {cfg.output_dir}{old}")
    compare_resumed(cfg, read_config(Path(cfg.output_dir)), world_size)
    done = re.match(r"ckpt_step(\d+)", path.name)
    if done and int(done.group(1)) >= cfg.steps:
        raise ValueError(f"--resume: {path} is at step {done.group(1)} and --steps is {cfg.steps}: nothing to do; "
                         f"raise --steps to continue the run{unfinished_export(cfg, path)}")
    return path


def unfinished_export(cfg: TrainConfig, ckpt: Path) -> str:
    """A finished run whose end-of-run export never completed (killed, or a full disk): the command
    that writes it from the last checkpoint, for "nothing to do" to name ("" when the export is
    there, or the run has none); --resume's refusal and --auto-resume's ``Complete`` both end with it."""
    out = cfg.export_dir
    if out is None or outpaths.is_export(out):
        return ""
    left = outpaths.temporary(out)
    why = f"a killed export left {left}" if left.exists() else f"no {out}"
    return (f"; the run's export did not finish ({why}): python -m gradnorm.export {cfg.output_dir} --out {out} "
            f"writes it from {ckpt.name}")
