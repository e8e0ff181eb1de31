"""One optimizer step on real gloo processes next to its simulation (notebook 02).

``ddp_check`` spawns W processes through ``harness.run_ddp`` (DDP, gradient accumulation, the one
all-reduce of counts) and compares the reduced gradient of each mode with
``sweeps.policy_gradient``: the same step simulated in one process, and the full batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradnorm.teach.harness import Case, run_ddp
from gradnorm.core.modes import MODE_NAMES, resolve
from gradnorm.core.sharding import make_plan
from gradnorm.teach.sweeps import GROUP_SIZE, MAX_LEN, compare, policy_gradient


@dataclass(frozen=True)
class DdpCheck:
    """One mode on real gloo ranks next to the in-process simulation of the same step."""

    mode: str
    max_abs_diff: float  # max |real - simulated| over the gradient's entries
    relative_error: float  # |real - full batch| / |full batch|
    cosine: float  # cosine(real, full batch)


def ddp_check(
    lengths: Sequence[int], modes: Sequence[str] = MODE_NAMES, shard: str = "length", world_size: int = 2,
    accum_steps: int = 2,
) -> list[DdpCheck]:
    """Run one optimizer step per mode on ``world_size`` real gloo processes (DDP, accumulation).

    Spawns the processes once (``harness.run_ddp``, about 10 s on 2 cores) and returns, per
    mode, how far the real gradient is from the simulation and from the full-batch gradient.
    """
    lengths = tuple(int(x) for x in lengths)
    if max(lengths) > MAX_LEN or len(lengths) % GROUP_SIZE:
        raise ValueError(f"run_ddp's minibatch needs lengths <= {MAX_LEN} in groups of {GROUP_SIZE}")
    cases = [Case(resolve(m, len(lengths), MAX_LEN), accum_steps, shard, lengths=lengths) for m in modes]
    real = run_ddp(world_size, cases)[0]["grads"]  # every rank holds the same reduced gradient
    plan = make_plan(shard, torch.tensor(lengths), world_size, accum_steps)
    out = []
    for k, m in enumerate(modes):
        rel, cos = compare(real[k], policy_gradient(lengths, m, None))
        diff = float((real[k] - policy_gradient(lengths, m, plan)).abs().max())
        out.append(DdpCheck(mode=m, max_abs_diff=diff, relative_error=rel, cosine=cos))
    return out
