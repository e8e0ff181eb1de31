"""Checkpoints that survive a crash mid-write and load with ``torch.load(weights_only=True)``.

A checkpoint is written to a temporary file in the destination directory and then renamed over
``ckpt_step{N}.pt`` with ``os.replace``: on POSIX a rename within one filesystem is atomic, so a
reader sees either the old file or the complete new one, never a torn write. Everything in it is a
tensor, a number, a string or a container of those, which is what ``weights_only=True`` (the safe
unpickler) accepts; RNG states are therefore stored as tensors.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

_NAME = re.compile(r"^ckpt_step(\d+)\.pt$")


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    """Where the checkpoint taken after optimizer step ``step`` lives."""
    return Path(output_dir) / f"ckpt_step{step}.pt"


def save_atomic(state: dict[str, Any], path: str | Path) -> Path:
    """torch.save ``state`` to ``path`` atomically: temporary file in the same directory, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


TRAINER_KEYS = ("model", "optimizer", "step", "rng", "warmup", "elapsed_s")
"""What a checkpoint written by gradnorm/train.py holds at least."""


def load(path: str | Path, map_location: str | torch.device = "cpu", required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load a checkpoint with the safe unpickler (tensors and plain containers only).

    A missing, truncated or corrupt file, one that the safe unpickler refuses (a pickle naming a
    class or function, e.g. a malicious ``__reduce__``), or one without the ``required`` keys is a
    one-line ``ValueError`` naming the file and what to do; nothing in it is ever executed.
    """
    path = Path(path)
    advice = "delete it to resume from an earlier checkpoint, or start over without --resume"
    if not path.is_file():
        raise ValueError(f"checkpoint {path} does not exist")
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": noise next to the error below
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises RuntimeError, UnpicklingError, EOFError... with long messages
        if isinstance(err, pickle.UnpicklingError):  # never suggest weights_only=False, as torch's message does
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
            what = f"it references {found.group(1)}" if found else "it holds more than tensors and plain containers"
            raise ValueError(f"checkpoint {path} is refused by the safe unpickler (weights_only=True): {what}, "
                             f"so it is not a gradnorm checkpoint and may be malicious; {advice}") from None
        first = (str(err).strip().splitlines() or [""])[0][:160]
        raise ValueError(f"checkpoint {path} is truncated or corrupt ({type(err).__name__}: {first}); {advice}") from None
    missing = [k for k in required if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"checkpoint {path} is not a gradnorm trainer checkpoint (missing {', '.join(missing)}); "
                         f"{advice}")
    return state


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint with the highest step in ``output_dir``, or None (temporary files are ignored)."""
    found = [(int(m.group(1)), p) for p in Path(output_dir).glob("ckpt_step*.pt") if (m := _NAME.match(p.name))]
    return max(found)[1] if found else None


def rng_state() -> dict[str, Any]:
    """Every RNG a run might draw from, as tensors: torch (CPU and CUDA), Python, NumPy."""
    py_version, py_words, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([py_version, *py_words], dtype=torch.int64),
        "python_gauss": torch.tensor([] if py_gauss is None else [py_gauss], dtype=torch.float64),
        "numpy": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_extra": torch.tensor([np_pos, np_has_gauss, np_gauss], dtype=torch.float64),
    }
    assert np_kind == "MT19937"
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` captured."""
    torch.set_rng_state(state["torch"])
    words = state["python"].tolist()
    gauss = state["python_gauss"].tolist()
    random.setstate((words[0], tuple(words[1:]), gauss[0] if gauss else None))
    pos, has_gauss, cached = state["numpy_extra"].tolist()
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
