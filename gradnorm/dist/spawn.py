"""Real processes on one machine: spawned gloo ranks, and a counter of the collectives they issue.

``spawn_gloo(fn, world_size, ...)`` is the one launcher of spawned gloo workers (the multi-process
checks of ``gradnorm.teach.harness``, the tests and the benchmarks use it); ``count_collectives``
counts the torch.distributed calls made from Python inside a block, which is how the tests prove
that gradnorm adds exactly one collective per minibatch.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradnorm.dist import comm


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "broadcast", "reduce", "all_to_all", "barrier", "gather", "scatter")


@contextmanager
def count_collectives():
    """Count the torch.distributed collectives issued from Python inside the block.

    DDP's own gradient all-reduce runs inside its C++ reducer and is not counted: what this sees
    is exactly what gradnorm adds on top of DDP.
    """
    calls = {"n": 0}
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(fn):
        def counted(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # W processes share few cores
    ctx = comm.setup(backend="gloo", device="cpu", timeout_s=300)
    try:
        torch.save(fn(ctx, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        comm.teardown()
    # Done: the result is on disk. A failure above instead returns through mp.spawn, which sends
    # its traceback to the parent; a success must not go through finalization (see its docstring).
    comm.exit_without_finalizing(0)


def spawn_gloo(fn: Callable, world_size: int, *args) -> list:
    """Run ``fn(ctx, *args)`` on ``world_size`` spawned gloo processes; return each rank's result.

    ``fn`` must be importable by name (a module-level function) and return tensors, numbers,
    strings, lists or dicts of them: results travel through ``torch.save`` and come back through
    ``torch.load(weights_only=True)``.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_spawned, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world_size)]
