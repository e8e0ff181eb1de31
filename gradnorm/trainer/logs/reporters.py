"""--report-to: the same lines, also in TensorBoard and Weights & Biases (rank 0).

``Reporters`` gets every line ``write_record`` writes and logs its numeric keys under their names
at the line's step; the run's flags (config.json's, with the world size) as its config; and the
learning curve at the end. The directories are ``output-dir/tensorboard`` and ``output-dir/wandb``,
so a run's logs move, resume and go to ``previous_run/`` with it. Nothing needs a network: W&B
runs offline unless WANDB_MODE says otherwise (``wandb sync output-dir/wandb/offline-run-*``
uploads it). A resumed run continues the same curves from its checkpoint's step k, without the
steps an interrupted run logged after k (metrics.jsonl drops those lines too): TensorBoard's
``purge_step`` k + 1 tells its reader to hide them, and W&B rewinds the same run id, kept in
``output-dir/wandb/run_id``, to step k (``resume_from``). Each start of a W&B run is a directory
of its own in offline mode; ``wandb sync`` replays them in order."""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path

from gradnorm.core.errors import first_line
from gradnorm.trainer.config import TrainConfig


def numeric(record: dict) -> dict[str, float]:
    """The numeric keys of a metrics line, step aside (no None, bool, string or list)."""
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
"""What a W&B run id may be: letters, digits, - and _ (this trainer writes 8 hex digits)."""


def read_run_id(id_file: Path) -> str:
    """The W&B run id kept in ``id_file``, or a one-line ValueError when the file holds none (torn, overwritten)."""
    text = id_file.read_bytes().decode("utf-8", errors="replace").strip()
    if not RUN_ID.fullmatch(text):
        raise ValueError(f"--report-to wandb: {id_file} holds no W&B run id ({ascii(text[:40])}); delete it to log this "
                         "resumed run as a new W&B run")
    return text


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
            if id_file.exists() and not id_file.is_file():
                raise ValueError(f"--report-to wandb: {id_file} is a directory, not the file that keeps the W&B run's "
                                 "id; remove it (the run's W&B curve then starts afresh)")
            known = step > 0 and id_file.is_file()
            run_id = read_run_id(id_file) if known else secrets.token_hex(4)
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
                hint = "; unset WANDB_MODE to log offline" if not self._offline else (
                    f"; it was resuming W&B run {run_id} (from {id_file}) at step {step}" if known else "")
                raise ValueError(f"--report-to wandb: wandb.init failed ({first_line(err)}){hint}") from None

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
        if figure is not None and figure.is_file():
            if self._tb is not None:
                from matplotlib.image import (
                    imread,  # the figure exists, so matplotlib does
                )

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
