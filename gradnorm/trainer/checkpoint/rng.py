"""Every RNG a run draws from (Python, NumPy, torch CPU and CUDA), as tensors a checkpoint stores.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict[str, torch.Tensor]:
    """Every RNG a run might draw from, as tensors: torch (CPU and CUDA), Python, NumPy.

    The trainer's own randomness does not depend on them: rollouts and the warm-up draw from
    generators seeded by (seed, step), and TinyGPT and the tiny test models have no dropout. They
    are saved per rank so that anything drawing from the global RNGs (dropout in a Hugging Face
    model, a user's reward) continues its stream on resume.
    """
    py_version, py_words, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([py_version, *py_words], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if py_gauss is None else py_gauss, py_gauss is not None], dtype=torch.float64),
        "numpy": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_extra": torch.tensor([np_pos, np_has_gauss, np_gauss], dtype=torch.float64),
    }
    assert np_kind == "MT19937"
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what ``rng_state`` captured."""
    torch.set_rng_state(state["torch"])
    words = state["python"].tolist()
    gauss, has_gauss = state["python_gauss"].tolist()
    random.setstate((words[0], tuple(words[1:]), gauss if has_gauss else None))
    pos, has_gauss, cached = state["numpy_extra"].tolist()
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
