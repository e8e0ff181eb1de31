"""The multi-process check: real gloo ranks, real DDP, real accumulation, against the oracle.

``run_ddp(world_size, cases)`` spawns W processes with ``torch.multiprocessing``; each builds the
same small policy and the same ragged GRPO minibatch (``gradnorm.teach.toy.make_problem``), wraps the policy in DDP
and runs the trainer's step (``dist.comm.global_counts``, then
``gradnorm.core.accumulate.accumulate_gradients``) for every case (denominator, A, sharding),
counting the collectives it issues. The reduced gradient of every case comes back to the caller,
to be compared with a single-process full-batch oracle (tests, notebook 02).
``run_ddp(..., parallel="fsdp")`` wraps the policy in FSDP2 (``fully_shard``) instead; each rank
then holds a shard of the gradient, and the full one is gathered before it is returned.

The workers live here, importable, because spawned processes must import them by name; they are
launched by ``gradnorm.dist.spawn.spawn_gloo``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gradnorm.core.accumulate import accumulate_gradients
from gradnorm.core.denominators import Denominator
from gradnorm.core.sharding import make_plan
from gradnorm.dist import comm
from gradnorm.dist.spawn import count_collectives, spawn_gloo
from gradnorm.dist.wrap import flat_grad, wrap_fsdp
from gradnorm.teach.toy import TinyPolicy, make_policy, make_problem, token_losses


@dataclass(frozen=True)
class Case:
    """One optimizer step to run: which denominator, how many microbatches, which sharding."""

    denominator: Denominator
    accum_steps: int
    shard: str = "contiguous"
    lengths: tuple[int, ...] | None = None  # response lengths of the minibatch; None: the default


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


def run_ddp(world_size: int, cases: list[Case], dtype: torch.dtype = torch.float64,
            parallel: str = "ddp") -> list[dict[str, Tensor]]:
    """Run ``cases`` on ``world_size`` real gloo processes; return each rank's results.

    ``results[r]["grads"][k]`` is the flat reduced gradient of ``cases[k]`` on rank r, and
    ``results[r]["collectives"][k]`` the number of collectives gradnorm issued for it. After
    DDP's all-reduce every rank holds the same gradient; the caller can check that too.
    ``parallel="fsdp"`` uses FSDP2 instead of DDP. Its own all-gathers and reduce-scatters run
    inside torch, not through the ``torch.distributed`` names patched here (as DDP's all-reduce
    runs in C++), so the count stays what gradnorm adds (tests/distributed/test_fsdp.py checks it).
    """
    return spawn_gloo(_case_results, world_size, cases, dtype, parallel)
