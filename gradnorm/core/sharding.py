"""Explicit assignments of a minibatch's sequences to ranks and microbatches.

A plan is ``plan[r][m]``: a LongTensor of the sequence indices that rank r processes in its
microbatch m, and every sequence appears exactly once. Two ways to cut one:

- a fixed count, ``make_plan(kind, lengths, W, A)``: every rank holds A microbatches of S/(W A)
  sequences (``balanced`` packs them by tokens instead, so its microbatches hold different counts);
- a token budget, ``budget_plan(kind, lengths, W, budget, prompt_len)``: each rank's share is cut,
  in order, into microbatches of at most ``budget`` tokens (prompt and response: what a forward
  pass computes), so ranks hold different numbers of sequences and of microbatches, and S need
  not divide by anything. Ranks still run the same number of forward and backward passes (DDP syncs
  on one backward, FSDP2 all-gathers per forward): the trainer tops a short rank up with passes of
  zero weight (``gradnorm.core.accumulate``). Every rank computes the whole plan from the global
  lengths it already holds, so each knows every other rank's count without a collective.

Under the invariant denominators the plan changes nothing but floating-point rounding; under
``local`` it changes the update, and ``length`` shows by how much.
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


# ---------------------------------------------------------------------------------------------
# Token budgets: microbatches of at most B tokens, as many as each rank needs.
# ---------------------------------------------------------------------------------------------

BUDGET_KINDS: tuple[str, ...] = ("interleave", "contiguous", "length")
"""The shardings a budget can follow. ``balanced`` fixes W*A bins of tokens itself: no budget."""


def rank_shares(kind: str, lengths: Tensor, world_size: int) -> list[Tensor]:
    """Which sequences each rank holds, in the order its microbatches take them (no A: a budget cuts).

    ``contiguous``: consecutive slices; ``interleave``: sequence i to rank i mod W; ``length``:
    sorted by response length, then consecutive slices (rank 0 the shortest). The first S mod W
    ranks hold one sequence more.
    """
    if kind not in BUDGET_KINDS:
        raise ValueError(f"a token budget cannot follow --shard {kind!r}: it fixes W x A bins of its own; "
                         f"use one of {', '.join(BUDGET_KINDS)}")
    S = len(lengths)
    if kind == "interleave":
        return [torch.arange(S)[r::world_size] for r in range(world_size)]  # empty for r >= S (arange(r, S) raises)
    order = torch.sort(lengths, stable=True).indices if kind == "length" else torch.arange(S)
    base, extra = divmod(S, world_size)
    starts = [r * base + min(r, extra) for r in range(world_size + 1)]
    return [order[starts[r]:starts[r + 1]].clone() for r in range(world_size)]


def budget_microbatches(share: Tensor, cost: Tensor, budget: int) -> list[Tensor]:
    """Cut ``share`` (sequence indices, in order) into microbatches of at most ``budget`` tokens.

    ``cost[i]`` is sequence i's tokens. Greedy and in order: a microbatch takes sequences until
    the next one would overflow it. A rank without sequences gets no microbatch.
    """
    out, current, used = [], [], 0
    for i in share.tolist():
        c = int(cost[i])
        if c > budget:
            raise ValueError(f"a sequence of {c} tokens does not fit a microbatch budget of {budget} tokens")
        if current and used + c > budget:
            out.append(torch.tensor(current, dtype=torch.long))
            current, used = [], 0
        current.append(i)
        used += c
    if current:
        out.append(torch.tensor(current, dtype=torch.long))
    return out


def budget_plan(kind: str, lengths: Tensor, world_size: int, budget: int, prompt_len: int = 0) -> Plan:
    """Each rank's share (``rank_shares``) cut into microbatches of at most ``budget`` tokens.

    A sequence costs ``prompt_len + |o_i|`` tokens: the positions a forward pass computes for it,
    which is what a token budget bounds (memory and time). Ranks may hold different numbers of
    microbatches, and a rank may hold none.
    """
    cost = lengths.cpu().to(torch.int64) + prompt_len
    return [budget_microbatches(share, cost, budget) for share in rank_shares(kind, lengths.cpu(), world_size)]


def passes(plan: Plan) -> int:
    """How many forward and backward passes every rank runs: the most microbatches any rank holds."""
    return max(1, max(len(rank) for rank in plan))


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


def validate_plan(plan: Plan, num_sequences: int, equal_microbatches: bool = False) -> None:
    """Every sequence exactly once (and, if asked, the same number of microbatches on every rank)."""
    if not plan or (equal_microbatches and len({len(rank) for rank in plan}) != 1):
        raise ValueError("every rank must have the same number of microbatches")
    seen = torch.cat([mb for rank in plan for mb in rank]).sort().values
    if not torch.equal(seen, torch.arange(num_sequences)):
        raise ValueError("a plan must assign every sequence exactly once")


def tokens_per_rank(plan: Plan, lengths: Tensor) -> list[int]:
    """How many response tokens each rank holds under ``plan``."""
    return [int(sum(lengths[mb].sum() for mb in rank)) for rank in plan]
