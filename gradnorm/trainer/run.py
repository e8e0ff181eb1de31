"""The run directory and what a run writes into it as it goes: the lock, config.json, metrics.jsonl,
the phase times of every step, the learning curve.

Phase times
-----------

Where an optimizer step's time goes: a lap timer the trainer calls between its numbered steps.

The trainer calls ``timer.lap(name)`` at the end of each phase; a lap charges the time since the
previous lap to ``name``. Nothing between two laps goes unaccounted, so the phases of a step add
up exactly to the wall time between two lines of metrics.jsonl (the step time):

    rollout           sampling the global batch and scoring it with the reward (generation)
    scoring           log-probs of the sampling policy and of the reference (no_grad forwards)
    shard             picking the minibatch and the sharding plan
    counts            THE all-reduce of token counts (the fix; ~0 for local and a constant)
    forward_backward  every microbatch's forward and backward, DDP's gradient all-reduce included
    optimizer         gradient clipping, the logging all-reduce of statistics, the AdamW step
    log               after the previous step's record: the max of phase times over ranks (one
                      small all-reduce), writing the line, the progress bar
    checkpoint        the checkpoint written after the previous step (0 when none was due)

``log`` and ``checkpoint`` come after a step's line is written (a checkpoint must never exist
without its line), so each record carries those of the step before it; the last checkpoint's
time is printed at the end of the run.

Collectives make a fast rank wait for a slow one, and the wait shows up on the fast rank in the
phase that holds the collective. That is why the phases where ranks' work can differ also get
their max over ranks (``*_max_s``): one all-reduce MAX of a vector of a few floats per step, the
same size for any W (``reduce_max``; the identity in one process).

On CUDA, kernels run asynchronously: a lap first synchronizes the device, so a phase is charged
for the work it launched, not for whatever the next phase waited on. On CPU it synchronizes
nothing (and costs nothing).

The run directory
-----------------

The run directory: never lose a run, never let two runs write one directory, remember every resume.

Rules (rank 0 alone writes; every rank takes the same read-only decisions):

- A fresh run (no --resume) refuses a directory that holds a run (config.json, metrics.jsonl or a
  checkpoint) unless --overwrite is given.
- --overwrite deletes nothing up front: the old run's files and checkpoint directories (torn
  ``.ckpt_step*.tmp`` ones included) move to ``previous_run/`` and are deleted only once the new run
  has a complete checkpoint (``checkpoints.latest_checkpoint``: a renamed ``ckpt_step{N}/``, never
  a ``.tmp``), at its end or at the next start. If the new run stops before that, its partial files
  go and the old run moves back; after a crash that left no chance to do so (SIGKILL, perhaps
  mid-save), the next start refuses with the way out.
- ``.lock`` holds the owner's pid and host. A second run on the directory refuses; a lock whose
  pid is dead on this host is stale (a killed run) and is taken over with a warning.
- --resume compares the flags that define the run with config.json (``compare_resumed``);
  config.json keeps the latest values at the top level and every start in ``history``.

The metrics log
---------------

What a run writes as it goes: metrics.jsonl (one record per optimizer step), the console, the summary.

Rank 0 alone writes. ``open_metrics`` cuts a resumed run's file back to its checkpoint (torn or
foreign lines dropped with a warning), ``step_record`` builds one line from global statistics (the
same on every rank), ``write_record`` appends it and shows it, ``summarize`` prints the outcome and
draws the learning curve.

The learning curve (``learning_curve.png``) is drawn by ``gradnorm.trainer.curves``, which loads no
distributed code, so the notebooks draw it too.

Reporters
---------

--report-to: the same lines, also in TensorBoard and Weights & Biases (rank 0).

``Reporters`` gets every line ``write_record`` writes and logs its numeric keys under their names
at the line's step; the run's flags (config.json's, with the world size) as its config; and the
learning curve at the end. The directories are ``output-dir/tensorboard`` and ``output-dir/wandb``,
so a run's logs move, resume and go to ``previous_run/`` with it. Nothing needs a network: W&B
runs offline unless WANDB_MODE says otherwise (``wandb sync output-dir/wandb/offline-run-*``
uploads it). A resumed run continues the same curves from its checkpoint's step k, without the
steps an interrupted run logged after k (metrics.jsonl drops those lines too): TensorBoard's
``purge_step`` k + 1 tells its reader to hide them, and W&B rewinds the same run id, kept in
``output-dir/wandb/run_id``, to step k (``resume_from``). Each start of a W&B run is a directory
of its own in offline mode; ``wandb sync`` replays them in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from fractions import Fraction
import torch
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from gradnorm.core.errors import first_line
from gradnorm.core.denominators import parse_denominator
from gradnorm.trainer.checkpoints import latest_checkpoint
from gradnorm.trainer.config import changeable_on_resume
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.outpaths import FINAL, is_export
import re
import secrets
from gradnorm.trainer.curves import read_metrics, write_learning_curve


# ------------------------------------------------------------------ Where an optimizer step's time goes: a la

PHASES = ("rollout", "scoring", "shard", "counts", "forward_backward", "optimizer", "log", "checkpoint")
"""Every phase of a step, in the order the trainer laps them."""
MAX_PHASES = ("rollout", "scoring", "forward_backward")
"""Phases whose work can differ between ranks; their max over ranks is logged too."""
METRIC_KEYS = tuple(f"time_{p}_s" for p in PHASES) + tuple(f"time_{p}_max_s" for p in MAX_PHASES)
"""The keys a step's record gets (all measured, so none enters a determinism comparison)."""


class PhaseTimer:
    """Laps of one step, charged to named phases; ``split`` closes the step and starts the next.

    ``clock`` is injectable for tests; ``device`` decides whether a lap synchronizes CUDA first.
    """

    def __init__(self, device: torch.device | str = "cpu", clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._sync = torch.device(device).type == "cuda"
        self.last = clock()
        """The time of the latest lap (the trainer's step clock reads it, so both agree exactly)."""
        self._times = dict.fromkeys(PHASES, 0.0)

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to ``phase``."""
        if self._sync:
            torch.cuda.synchronize()
        now = self._clock()
        self._times[phase] += now - self.last  # KeyError for a misspelt phase, on purpose
        self.last = now

    def split(self, reduce_max: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, float]:
        """This step's phase times as metrics (``time_<phase>_s``, ``time_<phase>_max_s``); then reset.

        ``reduce_max`` all-reduces a float64 vector with MAX over ranks in place (every rank must
        call ``split`` at the same point of the step); the default is one process.
        """
        times, self._times = self._times, dict.fromkeys(PHASES, 0.0)
        worst = reduce_max(torch.tensor([times[p] for p in MAX_PHASES], dtype=torch.float64)).tolist()
        return {**{f"time_{p}_s": times[p] for p in PHASES},
                **{f"time_{p}_max_s": t for p, t in zip(MAX_PHASES, worst)}}

    def peek(self, phase: str) -> float:
        """Seconds charged to ``phase`` since the last ``split`` (the final checkpoint's, say)."""
        return self._times[phase]


# ------------------------------------------------------------------ The run directory: never lose a run, neve

LOCK = ".lock"
PREVIOUS = "previous_run"
RUN_FILES = ("config.json", "metrics.jsonl", "warmup.json", "learning_curve.png", "tensorboard", "wandb")
"""A run's records; the last two are the directories of --report-to."""


def run_files(out: Path) -> list[Path]:
    """The files of a run in ``out``: its records, its checkpoint directories (old single-file
    ``ckpt_step*.pt`` ones too), torn ``.ckpt_step*.tmp`` directories and its Hugging Face export
    ``final/`` when an export wrote it (not the lock, not previous_run/, not a user's own final/)."""
    records = [out / name for name in RUN_FILES if (out / name).exists()]
    export = [out / FINAL] if is_export(out / FINAL) else []  # else --overwrite left the old policy in the new run
    return sorted(records + export + list(out.glob("ckpt_step*")) + list(out.glob(".ckpt_step*.tmp")))


def has_checkpoint(out: Path) -> bool:
    """Whether ``out`` holds a complete checkpoint, the one thing that makes a run resumable."""
    return latest_checkpoint(out) is not None


def check(out: Path, resume: bool, overwrite: bool) -> None:
    """The read-only decision every rank takes before anything is written; a one-line ValueError."""
    stranded = (out / PREVIOUS).is_dir() and not has_checkpoint(out)
    if stranded and not overwrite:
        raise ValueError(f"{out / PREVIOUS} holds the run that an --overwrite replaced, and the replacement "
                         f"stopped before its first checkpoint: move everything in {PREVIOUS}/ back into {out} to keep "
                         "the old run, or give --overwrite again to start over")
    found = run_files(out) if out.is_dir() else []
    if found and not resume and not overwrite:
        names = ", ".join(p.name for p in found[:3]) + (", ..." if len(found) > 3 else "")
        raise ValueError(f"--output-dir {out} holds a run ({names}): --resume to continue it, --overwrite to "
                         "replace it, or choose another --output-dir")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class RunDir:
    """Rank 0's handle on the output directory: the lock, and setting an old run aside."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.created: list[Path] = []
        """Directories this process created (removed again if they are still empty at the end)."""
        self.locked = False
        self.fresh = True

    def open(self, resume: bool, overwrite: bool) -> None:
        """Create the directory, take the lock, then settle previous_run/ (raises a one-line ValueError)."""
        missing = [p for p in [self.out, *self.out.parents] if not p.exists()]
        self.out.mkdir(parents=True, exist_ok=True)
        self.created, self.fresh = missing, not resume  # deepest first
        self._lock()
        previous = self.out / PREVIOUS
        if previous.is_dir() and has_checkpoint(self.out):  # its replacement reached a checkpoint
            shutil.rmtree(previous)
        if overwrite:
            if previous.is_dir():  # a replacement stranded without a checkpoint: its partial files go
                self._remove(run_files(self.out))
            elif run_files(self.out):
                previous.mkdir()
                for path in run_files(self.out):
                    path.rename(previous / path.name)
                print(f"warning: --overwrite: the previous run in {self.out} is in {previous}/ until this run's "
                      "first checkpoint exists", file=sys.stderr, flush=True)

    def close(self, succeeded: bool) -> None:
        """Delete previous_run/ once replaced, or move it back; release the lock; remove what stayed empty."""
        if self.locked:  # without the lock the directory may be another run's: touch nothing in it
            try:
                self._settle(succeeded)
            finally:
                (self.out / LOCK).unlink(missing_ok=True)
                self.locked = False
        if not succeeded:
            for path in self.created:  # nothing half-written: a directory we made and left empty goes
                try:
                    path.rmdir()
                except OSError:
                    break

    def _settle(self, succeeded: bool) -> None:
        previous = self.out / PREVIOUS
        if previous.is_dir():
            if has_checkpoint(self.out):
                shutil.rmtree(previous)
            elif not succeeded:
                self._remove(run_files(self.out))
                for path in previous.iterdir():
                    path.rename(self.out / path.name)
                previous.rmdir()
                print(f"warning: this run stopped before its first checkpoint; the previous run is back in "
                      f"{self.out}", file=sys.stderr, flush=True)
        elif not succeeded and self.fresh and not has_checkpoint(self.out) and not _logged(self.out):
            self._remove(run_files(self.out))  # a fresh run that failed before its first step leaves nothing

    def _lock(self) -> None:
        path, me = self.out / LOCK, {"pid": os.getpid(), "host": socket.gethostname(), "started": _now()}
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = _read_lock(path)
                if owner.get("host") == me["host"] and isinstance(owner.get("pid"), int) and not _pid_alive(owner["pid"]):
                    print(f"warning: {path} was left by pid {owner['pid']}, which is no longer running (a killed "
                          "run); taking it over", file=sys.stderr, flush=True)
                    path.unlink(missing_ok=True)
                    continue
                who = f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}"
                raise ValueError(f"--output-dir {self.out} is in use by another run ({who}, since "
                                 f"{owner.get('started', '?')}); wait for it, or delete {path} if that run is gone") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.locked = True
            return
        raise ValueError(f"--output-dir {self.out}: could not take the lock {path}; another run took it first")

    @staticmethod
    def _remove(paths: list[Path]) -> None:
        for path in paths:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _logged(out: Path) -> bool:
    metrics = out / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def _read_lock(path: Path) -> dict:
    try:
        owner = json.loads(path.read_text())
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):  # torn or foreign: not provably stale, so it is respected
        return {}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# ------------------------------------------------------------------ config.json and --resume


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


def changed_flags(cfg: TrainConfig, old: dict) -> dict[str, list]:
    """{field: [old value, new value]} for every flag that differs from the old run's config.json."""
    new = cfg.to_dict()
    return {name: [old[name], value] for name, value in new.items()
            if name in old and not _same(name, old[name], value) and name not in ("resume", "overwrite")}  # how, not what


def compare_resumed(cfg: TrainConfig, old: dict | None) -> None:
    """A one-line ValueError naming every flag that defines the run and differs from ``old``."""
    if old is None:
        return
    denominator = old.get("loss_denominator", cfg.loss_denominator)
    fixed = {name: pair for name, pair in changed_flags(cfg, old).items()
             if not changeable_on_resume(name, denominator)}
    if fixed:
        listed = ", ".join(f"--{name.replace('_', '-')} {old_value} -> {new_value}"
                           for name, (old_value, new_value) in fixed.items())
        raise ValueError(f"--resume: the flags that define the run differ from {cfg.output_dir}/config.json: {listed}; "
                         "resume with the run's values, or start a new run (another --output-dir, or --overwrite)")


def write_config(out: Path, cfg: TrainConfig, world_size: int, step: int) -> None:
    """config.json: every flag of the run as of now, and ``history`` with one entry per start."""
    old = read_config(out) if cfg.resume else None
    entry = {"started": _now(), "step": step, "world_size": world_size}
    if cfg.resume:
        entry["changed"] = {} if old is None else changed_flags(cfg, old)
        if old is None:
            entry["note"] = "resumed without a config.json: flags not compared"
    history = (old or {}).get("history", [])
    config = {**cfg.to_dict(), "world_size": world_size, "history": [*history, entry]}
    tmp = out / ".config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out / "config.json")  # a crash mid-write leaves the old config.json


# ------------------------------------------------------------------ What a run writes as it goes: metrics.jso

TIMING_KEYS = ("tokens_per_second", "elapsed_s", "max_memory_gib", *METRIC_KEYS)
"""Measured metrics (wall time; CUDA memory): everything else in metrics.jsonl is a function of the config."""

BAR_PHASES = ("rollout", "forward_backward", "optimizer")
"""Phase times (gradnorm.trainer.run) the progress bar shows beside the reward."""


def open_run_files(out: Path, cfg: TrainConfig, world_size: int, step: int, warmup: dict, record: dict | None = None):
    """config.json (with its history), warmup.json, and metrics.jsonl opened for appending after ``step``
    (``record``: the checkpoint's copy of the line of ``step``)."""
    out.mkdir(parents=True, exist_ok=True)
    write_config(out, cfg, world_size, step)
    (out / "warmup.json").write_text(json.dumps(warmup, indent=2) + "\n")
    return open_metrics(out / "metrics.jsonl", step, record)


def sync(metrics) -> None:
    """metrics.jsonl's lines on disk, not only in the page cache: called before each checkpoint."""
    metrics.flush()
    os.fsync(metrics.fileno())


def open_metrics(path: Path, keep_through_step: int, record: dict | None = None):
    """metrics.jsonl for appending, cut back to the steps <= ``keep_through_step`` (0: a fresh file).

    A resumed run's file may be missing (it starts again after the checkpoint's step), end in a
    torn line (a crash mid-write) or hold lines that are not records (edited by hand): those lines
    are dropped with a warning naming the file and the line. The line of the checkpoint's own step
    is never lost silently: when it is gone, ``record`` (the checkpoint's copy of it) takes its
    place, or a warning says it is lost (a checkpoint of an earlier version holds no copy). The cut
    file replaces the old one atomically, so a crash now loses nothing.
    """
    kept, logged = [], set()
    if keep_through_step > 0 and not path.exists():
        print(f"warning: {path} is missing; it starts again at step {keep_through_step + 1}", file=sys.stderr, flush=True)
    elif keep_through_step > 0:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for number, line in enumerate(lines, start=1):
            try:
                step = json.loads(line)["step"] if line.strip() else None
            except (ValueError, KeyError, TypeError):
                step = "bad"
            if step is None:
                continue
            if not isinstance(step, int) or isinstance(step, bool):
                why = "a torn last line (the run stopped mid-write)" if number == len(lines) else "not a metrics record"
                print(f"warning: {path}:{number}: dropped {why}", file=sys.stderr, flush=True)
            elif step <= keep_through_step:
                kept.append(line)
                logged.add(step)
        if keep_through_step not in logged and record is not None and record.get("step") == keep_through_step:
            kept.append(json.dumps(record))
            print(f"warning: {path}: the record of step {keep_through_step} was torn or missing; restored from "
                  "its checkpoint", file=sys.stderr, flush=True)
        elif keep_through_step not in logged:
            print(f"warning: {path}: the record of step {keep_through_step} is torn or missing and its checkpoint "
                  "holds no copy (an earlier version wrote it): that step has no line", file=sys.stderr, flush=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return open(path, "a")


def resume_point(cfg: TrainConfig) -> Path | None:
    """The checkpoint --resume continues from, once the run it continues is known to match.

    One-line ValueErrors: no checkpoint; a flag that defines the run differs from config.json
    (``compare_resumed``); --steps not beyond the checkpoint's step.
    """
    if not cfg.resume:
        return None
    path = latest_checkpoint(cfg.output_dir)
    if path is None:
        old = " (its ckpt_step*.pt files are the single-file format of earlier versions)" \
            if any(Path(cfg.output_dir).glob("ckpt_step*.pt")) else ""
        raise ValueError(f"--resume: no complete checkpoint ckpt_step*/ in {cfg.output_dir}{old}")
    compare_resumed(cfg, read_config(Path(cfg.output_dir)))
    done = re.match(r"ckpt_step(\d+)", path.name)
    if done and int(done.group(1)) >= cfg.steps:
        raise ValueError(f"--resume: {path} is at step {done.group(1)} and --steps is {cfg.steps}: nothing to do; "
                         "raise --steps to continue the run")
    return path


def timing_fields(device: torch.device) -> dict:
    """CUDA's peak memory, when there is a GPU (a measurement, like the phase times)."""
    return {"max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30} if device.type == "cuda" else {}


def write_record(metrics, bar, record: dict, cfg: TrainConfig) -> None:
    """Append the record to metrics.jsonl and show it (progress bar, or a line every --log-every steps).

    A skipped step's non-finite statistics are None in the record; they print as null.
    """
    metrics.write(json.dumps(record) + "\n")
    metrics.flush()

    def show(key: str, spec: str) -> str:
        return "null" if record.get(key) is None else format(record[key], spec)

    timed = [p for p in BAR_PHASES if record.get(f"time_{p}_s") is not None]  # where the step's time went
    bar.update(1)
    skew = {"skew": f"{record['skew_max']:.2f}x"} if record.get("skew_max") is not None else {}  # local's loudest token
    bar.set_postfix(reward=show("reward_mean", ".3f"), **skew, tok_s=show("tokens_per_second", ".0f"),
                    **{p: show(f"time_{p}_s", ".2f") + "s" for p in timed})
    step = record["step"]
    if bar.disable and (step % cfg.log_every == 0 or step == cfg.steps):
        print(" ".join([f"step {step}/{cfg.steps} reward {show('reward_mean', '.3f')} loss {show('loss', '.4f')} "
                        f"grad_norm {show('grad_norm', '.4f')} tokens/s {show('tokens_per_second', '.0f')}",
                        *(f"{p} {show(f'time_{p}_s', '.3f')}s" for p in timed)]), flush=True)


def summarize(out: Path, plot: bool) -> None:
    """Print the run's outcome and draw its learning curve (rank 0)."""
    rows = read_metrics(out / "metrics.jsonl")
    last = rows[-10:]
    warmup = json.loads((out / "warmup.json").read_text())
    print(f"reward: {warmup['reward_before']:.3f} before warm-up, {warmup['reward_after']:.3f} after; "
          f"mean of the last {len(last)} steps {sum(r['reward_mean'] for r in last) / len(last):.3f} "
          f"(max 1.0); {rows[-1]['elapsed_s']:.0f} s of GRPO")
    if not plot:
        return
    try:
        print(f"learning curve: {write_learning_curve(out)}")
    except ImportError:
        print("learning curve skipped: matplotlib is not installed (pip install -e '.[notebooks]')")


# ------------------------------------------------------------------ --report-to, the same lines to TensorBoar

_OPEN_REPORTERS: list[Reporters] = []
"""Reporters not closed yet: ``close_reporters`` finishes them when a run fails or stops."""


def numeric(record: dict) -> dict[str, float]:
    """The numeric keys of a metrics line, step aside (no None, bool, string or list)."""
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Reporters:
    """Rank 0's --report-to loggers, opened at ``step`` (0 for a fresh run, k when resumed from ckpt_step{k})."""

    def __init__(self, cfg: TrainConfig, out: Path, world_size: int, step: int):
        self.step = step
        self._tb = self._wandb = None
        flags = {**cfg.to_dict(), "world_size": world_size}
        if "tensorboard" in cfg.reporters:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard's reader hides every event of an earlier start at a step >= k + 1
            self._tb = SummaryWriter(str(out / "tensorboard"), purge_step=step + 1 if step else None)
            self._tb.add_text("config", "```json\n" + json.dumps(flags, indent=2) + "\n```", step)
        if "wandb" in cfg.reporters:
            import wandb

            self._offline = os.environ.get("WANDB_MODE", "offline") in ("offline", "dryrun")
            (out / "wandb").mkdir(exist_ok=True)
            id_file = out / "wandb" / "run_id"
            known = step > 0 and id_file.is_file()
            run_id = id_file.read_text().strip() if known else secrets.token_hex(4)
            id_file.write_text(run_id + "\n")
            # rewinding to step k drops what an interrupted start logged after its checkpoint
            which = dict(resume_from=f"{run_id}?_step={step}") if known else dict(id=run_id)
            try:
                self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "gradnorm"), name=out.resolve().name,
                                         dir=str(out), config=flags, mode=os.environ.get("WANDB_MODE", "offline"),
                                         settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
                                         **which)
            except Exception as err:  # online without a login or a network, say: one line, exit 1
                self.close(exit_code=1)
                raise ValueError(f"--report-to wandb: wandb.init failed ({first_line(err)}); unset WANDB_MODE "
                                 "to log offline") from None
        _OPEN_REPORTERS.append(self)

    def log(self, record: dict) -> None:
        """Every numeric key of a metrics line, under its own name, at the line's step."""
        self.step, values = record["step"], numeric(record)
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, self.step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=self.step)

    def close(self, figure: Path | None = None, exit_code: int = 0) -> None:
        """Log the learning curve (when given and drawn) at the last step, then finish every logger."""
        if self in _OPEN_REPORTERS:
            _OPEN_REPORTERS.remove(self)
        if figure is not None and figure.is_file():
            if self._tb is not None:
                from matplotlib.image import imread  # the figure exists, so matplotlib does

                self._tb.add_image("learning_curve", imread(figure), self.step, dataformats="HWC")
            if self._wandb is not None:
                import wandb

                self._wandb.log({"learning_curve": wandb.Image(str(figure))}, step=self.step)
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            where = Path(self._wandb.dir).parent  # its offline-run-*/ (files/ is inside)
            self._wandb.finish(exit_code=exit_code)
            if self._offline:
                print(f"wandb: offline run in {where}; upload it with: wandb sync {where}", flush=True)
        self._tb = self._wandb = None


def open_reporters(cfg: TrainConfig, out: Path, world_size: int, step: int) -> Reporters | None:
    """The loggers --report-to names (rank 0), or None for none."""
    return Reporters(cfg, out, world_size, step) if cfg.reporters else None


def close_reporters() -> None:
    """Finish whatever loggers a failed or stopped run left open (main's ``finally``): W&B's files
    are complete, and its process ends, even when the run does not."""
    for reporters in list(_OPEN_REPORTERS):
        reporters.close(exit_code=1)
