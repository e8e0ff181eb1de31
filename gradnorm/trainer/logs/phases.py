"""Where an optimizer step's time goes: a lap timer the trainer calls between its numbered steps.

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
nothing (and costs nothing)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

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
