"""The multi-process check: real gloo ranks, real DDP, real accumulation, against the oracle.

``run_ddp(world_size, cases)`` spawns W processes with ``torch.multiprocessing``; each builds the
same small policy and the same ragged GRPO minibatch (``gradnorm.toy.make_problem``), wraps the policy in DDP
and runs the trainer's step (``dist.comm.global_counts``, then
``gradnorm.update.accumulate_gradients``) for every case (denominator, A, sharding),
counting the collectives it issues. The reduced gradient of every case comes back to the caller,
to be compared with a single-process full-batch oracle (tests, notebook 02).
``run_ddp(..., parallel="fsdp")`` wraps the policy in FSDP2 (``fully_shard``) instead; each rank
then holds a shard of the gradient, and the full one is gathered before it is returned.

``spawn_gloo(fn, world_size, ...)`` is the one launcher of spawned gloo workers (the benchmarks use
it too); the workers live here, importable, because spawned processes must import them by name.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from gradnorm.dist import comm
from gradnorm.dist.wrap import flat_grad, wrap_fsdp
from gradnorm.denominators import Denominator
from gradnorm.sharding import make_plan
from gradnorm.toy import TinyPolicy, make_policy, make_problem, token_losses
from gradnorm.update import accumulate_gradients


@dataclass(frozen=True)
class Case:
    """One optimizer step to run: which denominator, how many microbatches, which sharding."""

    denominator: Denominator
    accum_steps: int
    shard: str = "contiguous"
    lengths: tuple[int, ...] | None = None  # response lengths of the minibatch; None: the default


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


def _wrap(policy: TinyPolicy, parallel_kind: str) -> nn.Module:
    if parallel_kind == "fsdp":
        # Shard the embedding and the hidden layer as their own units, then the root (the head),
        # so the check covers nested FSDP2 units as a transformer's blocks would have.
        return wrap_fsdp(policy, blocks=[policy.embed, policy.mlp])
    return nn.parallel.DistributedDataParallel(policy)


def _case_results(ctx: comm.DistContext, cases: list[Case], dtype: torch.dtype, parallel_kind: str) -> dict[str, Tensor]:
    wrapped = _wrap(make_policy(0, dtype), parallel_kind)
    grads, collectives = [], []
    for case in cases:
        problem = make_problem(lengths=case.lengths, dtype=dtype)
        plan = make_plan(case.shard, problem.lengths, ctx.world_size, case.accum_steps)
        wrapped.zero_grad(set_to_none=True)
        with count_collectives() as calls:
            counts = comm.global_counts(plan[ctx.rank], problem.lengths, problem.group_ids, problem.num_groups,
                                        case.denominator)
            accumulate_gradients(wrapped, plan[ctx.rank], problem.mask, problem.group_ids, counts,
                                 case.denominator, lambda idx: token_losses(wrapped, problem, idx), ctx.world_size)
        grads.append(flat_grad(wrapped))  # FSDP2: gathers every rank's shard (a collective)
        collectives.append(calls["n"])
    return {"grads": torch.stack(grads), "collectives": torch.tensor(collectives)}


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


def spawn_gloo(fn: Callable, world_size: int, *args) -> list:
    """Run ``fn(ctx, *args)`` on ``world_size`` spawned gloo processes; return each rank's result.

    ``fn`` must be importable by name (a module-level function) and return tensors, numbers,
    strings, lists or dicts of them: results travel through ``torch.save`` and come back through
    ``torch.load(weights_only=True)``.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_spawned, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world_size)]


def run_ddp(world_size: int, cases: list[Case], dtype: torch.dtype = torch.float64,
            parallel: str = "ddp") -> list[dict[str, Tensor]]:
    """Run ``cases`` on ``world_size`` real gloo processes; return each rank's results.

    ``results[r]["grads"][k]`` is the flat reduced gradient of ``cases[k]`` on rank r, and
    ``results[r]["collectives"][k]`` the number of collectives gradnorm issued for it. After
    DDP's all-reduce every rank holds the same gradient; the caller can check that too.
    ``parallel="fsdp"`` uses FSDP2 instead of DDP. Its own all-gathers and reduce-scatters run
    inside torch, not through the ``torch.distributed`` names patched here (as DDP's all-reduce
    runs in C++), so the count stays what gradnorm adds (tests/test_fsdp.py checks it).
    """
    return spawn_gloo(_case_results, world_size, cases, dtype, parallel)
