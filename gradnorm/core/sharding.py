"""Explicit assignments of a minibatch's sequences to ranks and microbatches.

A plan is ``plan[r][m]``: a LongTensor of the sequence indices that rank r processes in its
microbatch m. Every rank has the same number A of microbatches (DDP needs the same number of
backward passes on every rank), and every sequence appears exactly once. Under the invariant
denominators the plan changes nothing but floating-point rounding; under ``local`` it changes the
update, and ``length`` shows by how much.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
from torch import Tensor

Plan = list[list[Tensor]]
ShardKind = Literal["interleave", "contiguous", "length", "balanced"]
SHARD_KINDS: tuple[str, ...] = get_args(ShardKind)  # the one list of shardings


def check_divisible(num_sequences: int, world_size: int, accum_steps: int) -> None:
    """Raise a one-line error unless S sequences split evenly over W ranks x A microbatches."""
    if world_size < 1 or accum_steps < 1:
        raise ValueError(f"world size ({world_size}) and accumulation steps ({accum_steps}) must be >= 1")
    if num_sequences % (world_size * accum_steps):
        raise ValueError(
            f"a minibatch of {num_sequences} sequences cannot be split over {world_size} ranks x "
            f"{accum_steps} microbatches: make it a multiple of {world_size * accum_steps}"
        )


def _split(order: Tensor, world_size: int, accum_steps: int) -> Plan:
    # Consecutive runs of `order`: rank r gets the r-th slice, cut into A microbatches.
    per_rank = order.reshape(world_size, accum_steps, -1)  # (W, A, S / (W*A))
    return [[per_rank[r, m].clone() for m in range(accum_steps)] for r in range(world_size)]


def contiguous(lengths: Tensor, world_size: int, accum_steps: int) -> Plan:
    """Rank r gets sequences [r*S/W, (r+1)*S/W), in order: whole prompt groups stay together."""
    check_divisible(len(lengths), world_size, accum_steps)
    return _split(torch.arange(len(lengths)), world_size, accum_steps)


def interleave(lengths: Tensor, world_size: int, accum_steps: int) -> Plan:
    """Sequence i goes to rank i mod W, spreading every prompt group over the ranks."""
    check_divisible(len(lengths), world_size, accum_steps)
    order = torch.arange(len(lengths)).reshape(-1, world_size).T.reshape(-1)
    return _split(order, world_size, accum_steps)


def by_length(lengths: Tensor, world_size: int, accum_steps: int) -> Plan:
    """Sort by response length (stable) and split: rank 0's first microbatch gets the shortest.

    The maximal realistic imbalance: under ``local`` the ranks holding short responses "shout".
    """
    check_divisible(len(lengths), world_size, accum_steps)
    return _split(torch.sort(lengths, stable=True).indices, world_size, accum_steps)


def balanced(lengths: Tensor, world_size: int, accum_steps: int) -> Plan:
    """Pack by tokens: longest first, each into the W*A bin with the fewest tokens so far.

    The realistic "token budget" sharding. Bins hold different numbers of sequences, which also
    breaks a naive per-microbatch sequence mean. A bin may be empty when S < W*A.
    """
    bins: list[list[int]] = [[] for _ in range(world_size * accum_steps)]
    load = [0] * len(bins)
    for i in torch.sort(lengths, descending=True, stable=True).indices.tolist():
        b = min(range(len(bins)), key=lambda k: (load[k], len(bins[k]), k))
        bins[b].append(i)
        load[b] += int(lengths[i])
    as_tensor = [torch.tensor(sorted(b), dtype=torch.long) for b in bins]
    return [as_tensor[r * accum_steps : (r + 1) * accum_steps] for r in range(world_size)]


SHARDERS: dict[str, Callable[[Tensor, int, int], Plan]] = {
    "interleave": interleave,
    "contiguous": contiguous,
    "length": by_length,
    "balanced": balanced,
}


def make_plan(kind: str, lengths: Tensor, world_size: int, accum_steps: int) -> Plan:
    """Assign the sequences whose response lengths are ``lengths`` (S,) to W ranks x A microbatches."""
    try:
        sharder = SHARDERS[kind]
    except KeyError:
        raise ValueError(f"unknown sharding {kind!r}: expected one of {', '.join(SHARD_KINDS)}") from None
    return sharder(lengths, world_size, accum_steps)


def validate_plan(plan: Plan, num_sequences: int) -> None:
    """Every sequence exactly once, and the same number of microbatches on every rank."""
    if not plan or len({len(rank) for rank in plan}) != 1:
        raise ValueError("every rank must have the same number of microbatches")
    seen = torch.cat([mb for rank in plan for mb in rank]).sort().values
    if not torch.equal(seen, torch.arange(num_sequences)):
        raise ValueError("a plan must assign every sequence exactly once")


def tokens_per_rank(plan: Plan, lengths: Tensor) -> list[int]:
    """How many response tokens each rank holds under ``plan``."""
    return [int(sum(lengths[mb].sum() for mb in rank)) for rank in plan]
