"""Gradient sweeps: each mode's sharded gradient against the full batch, for GRPO, SFT and DPO.

Notebooks 02 and 05. ``ragged_lengths`` makes a minibatch's responses more ragged as the
spread k grows; ``policy_gradient`` is the gradient of one optimizer step of ``toy``'s policy
under a mode and a plan (``simulate.simulated_gradient``: W simulated ranks x A microbatches);
``gradient_sweep`` compares it with the full-batch gradient (``compare``) over spreads, with
GRPO's loss or SFT's cross-entropy. DPO averages over preference pairs: ``dpo_sweep`` packs pairs
under a token budget (``packed_pairs``) and measures the per-microbatch mean over pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gradnorm.core.modes import MODE_NAMES, resolve
from gradnorm.core.pairs import count_pairs, dpo_losses, pair_weights
from gradnorm.core.sharding import Plan, make_plan
from gradnorm.core.simulate import simulated_gradient
from gradnorm.teach.toy import Problem, make_policy, make_problem, token_logp, token_losses

MAX_LEN = 12  # harness.run_ddp's workers build make_problem with its default max_len = 12
GROUP_SIZE = 4  # ... and its default group size


def ragged_lengths(spread: float, num_sequences: int = 32, max_len: int = MAX_LEN, seed: int = 0) -> tuple[int, ...]:
    """Response lengths spread log-uniformly between max_len / spread and max_len (rounded).

    The same seeded draw u_i in [0, 1) serves every spread k: |o_i| = round(max_len * k^-u_i),
    at least 1. k = 1 makes every response max_len long; larger values make them ragged
    while keeping the same order. ``spread`` is the parameter of the draw, not the ratio of the
    longest to the shortest response: a finite draw need not reach either end (notebook 02 prints
    the lengths each value gives).
    """
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(num_sequences, generator=g, dtype=torch.float64)
    lengths = torch.round(max_len * spread ** (-u)).clamp(min=1, max=max_len)
    return tuple(int(x) for x in lengths)


def _flat(grads: Sequence[Tensor]) -> Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def sft_token_losses(policy: torch.nn.Module, problem: Problem, idx: Tensor) -> Tensor:
    """SFT's per-token loss, (n, T): the cross-entropy -log p(target) of every target token."""
    return -token_logp(policy, problem.inputs[idx], problem.targets[idx])


def policy_gradient(
    lengths: Sequence[int], mode: str, plan: Plan | None = None, seed: int = 0, loss: str = "grpo"
) -> Tensor:
    """The flat gradient of one optimizer step of ``toy``'s policy on its minibatch.

    ``loss="grpo"``: GRPO's per-token loss (``toy.token_losses``); ``loss="sft"``: the
    cross-entropy of the same tokens (``sft_token_losses``). ``plan=None`` is the full batch: one
    rank, one microbatch. The minibatch has the response ``lengths``; everything else about it
    (tokens, rewards, old and reference log-probs) is fixed by the seed, so only the lengths
    change between calls with different lengths.
    """
    problem = make_problem(lengths=lengths, group_size=GROUP_SIZE, max_len=MAX_LEN, seed=seed)
    policy = make_policy(seed)
    per_token_loss = {
        "grpo": lambda idx: token_losses(policy, problem, idx).loss,
        "sft": lambda idx: sft_token_losses(policy, problem, idx),
    }[loss]
    plan = [[torch.arange(len(lengths))]] if plan is None else plan
    denominator = resolve(mode, len(lengths), MAX_LEN)
    grads = simulated_gradient(per_token_loss, list(policy.parameters()), problem.mask, problem.group_ids,
                               problem.num_groups, denominator, plan)
    return _flat(grads)


def compare(grad: Tensor, reference: Tensor) -> tuple[float, float]:
    """(relative error |g - g_ref| / |g_ref|, cosine similarity) of two flat gradients."""
    ref_norm = float(reference.norm())
    if ref_norm == 0.0:
        return float(grad.norm()), 1.0 if float(grad.norm()) == 0.0 else 0.0
    rel = float((grad - reference).norm()) / ref_norm
    cos = float(torch.dot(grad, reference) / (grad.norm() * reference.norm()).clamp(min=1e-300))
    return rel, cos


@dataclass(frozen=True)
class GradientSweep:
    """Each mode's sharded gradient against its full-batch gradient, as lengths grow ragged."""

    shard: str
    world_size: int
    accum_steps: int
    x: np.ndarray  # (K,) the x axis: the spread k of ``ragged_lengths`` (unit tokens) or the pair ratio (pairs)
    microbatch_tokens: np.ndarray  # (K, W, A) N[r, m] under the sharding (DPO: pairs, see ``unit``)
    relative_error: dict[str, np.ndarray]  # mode -> (K,)
    cosine: dict[str, np.ndarray]  # mode -> (K,)
    unit: str = "tokens"  # what microbatch_tokens counts
    loss: str = "grpo"  # the objective measured: "grpo", "sft" or "dpo" (legends name a GRPO paper only for "grpo")


def gradient_sweep(
    spreads: Sequence[float],
    modes: Sequence[str] = MODE_NAMES,
    shard: str = "length",
    world_size: int = 2,
    accum_steps: int = 2,
    num_sequences: int = 32,
    seed: int = 0,
    loss: str = "grpo",
) -> GradientSweep:
    """For each spread k and mode: shard the minibatch, simulate W ranks x A microbatches, and
    compare the gradient with the same mode's full-batch gradient (W = A = 1).

    The full-batch gradient of ``local`` is the token mean's (one microbatch: one local mean), so
    ``local``'s error is its distance from the fix; the other modes' errors are rounding.
    """
    rel = {m: [] for m in modes}
    cos = {m: [] for m in modes}
    tokens = []
    for k in spreads:
        lengths = ragged_lengths(k, num_sequences, seed=seed)
        plan = make_plan(shard, torch.tensor(lengths), world_size, accum_steps)
        tokens.append([[sum(lengths[i] for i in mb.tolist()) for mb in rank] for rank in plan])
        for m in modes:
            r, c = compare(policy_gradient(lengths, m, plan, seed, loss), policy_gradient(lengths, m, None, seed, loss))
            rel[m].append(r)
            cos[m].append(c)
    return GradientSweep(
        shard=shard, world_size=world_size, accum_steps=accum_steps, x=np.asarray(spreads, dtype=float),
        microbatch_tokens=np.array(tokens), relative_error={m: np.array(v) for m, v in rel.items()},
        cosine={m: np.array(v) for m, v in cos.items()}, loss=loss,
    )


# ---------------------------------------------------------------------------------------------
# DPO: the same mistake in a mean over preference pairs (notebook 05)
# ---------------------------------------------------------------------------------------------

DPO_MODES = ("local", "pair")  # gradnorm.PAIR_MODES: the per-microbatch pair mean, and the fix
DPO_MAX_LEN = 64  # longer responses than the GRPO minibatch's, so that token packing moves pairs around


def dpo_pair_losses(policy: torch.nn.Module, problem: Problem, pairs: Tensor, beta: float = 0.1) -> Tensor:
    """DPO's loss of each preference pair, (n,): ``gradnorm.dpo_losses`` of the pairs' responses.

    Pair p is the chosen response 2p and the rejected response 2p + 1 of ``problem``, scored in one
    forward pass; the reference log-probs are the problem's ``ref_logp``.
    """
    chosen, rejected = 2 * pairs, 2 * pairs + 1
    both = torch.cat([chosen, rejected])
    logp = token_logp(policy, problem.inputs[both], problem.targets[both])  # (2n, T)
    ref, mask, n = problem.ref_logp[both], problem.mask[both], len(pairs)
    return dpo_losses(logp[:n], logp[n:], ref[:n], ref[n:], mask[:n], mask[n:], beta=beta)


def dpo_gradient(lengths: Sequence[int], mode: str, plan: Plan | None = None, seed: int = 0,
                 max_len: int = DPO_MAX_LEN) -> Tensor:
    """The flat gradient of one DPO step over the pairs of ``lengths`` (chosen, rejected, ...).

    W simulated ranks x A microbatches, as in a DDP loop: rank r backpropagates
    ``(W * v * l).sum()`` for each of its microbatches, v from ``gradnorm.pair_weights`` with the
    pair count P one all-reduce of ``count_pairs`` would return, and the ranks' gradients are
    averaged. ``plan`` assigns pairs to ranks and microbatches; ``None`` is the whole batch at once.
    """
    problem = make_problem(lengths=lengths, group_size=2, max_len=max_len, seed=seed)
    policy = make_policy(seed)
    params = list(policy.parameters())
    plan = [[torch.arange(len(lengths) // 2)]] if plan is None else plan
    world_size = len(plan)
    num_pairs = int(sum(count_pairs(len(mb)) for rank in plan for mb in rank))  # the one all-reduce
    reduced = [torch.zeros_like(p) for p in params]
    for rank in plan:
        for mb in rank:  # gradient accumulation: microbatch gradients add up
            losses = dpo_pair_losses(policy, problem, mb)
            v = pair_weights(len(mb), mode, world_size=world_size, accum_steps=len(rank), num_pairs=num_pairs,
                             dtype=losses.dtype)
            for acc, g in zip(reduced, torch.autograd.grad((world_size * v * losses).sum(), params)):
                acc += g
    return _flat([g / world_size for g in reduced])  # DDP's mean over ranks


def packed_pairs(
    pair_ratio: float, world_size: int = 2, accum_steps: int = 2, pairs_per_microbatch: int = 8, short_length: int = 6,
) -> tuple[tuple[int, ...], Plan]:
    """Preference pairs packed under one token budget per microbatch: long pairs, fewer per microbatch.

    Every microbatch holds the same tokens, 2 * short_length * pairs_per_microbatch. Rank 0's
    first one holds n = max(1, round(pairs_per_microbatch / pair_ratio)) long pairs (responses of
    short_length * pairs_per_microbatch / n tokens); every other one holds pairs_per_microbatch
    short pairs. Returns the response lengths (chosen, rejected, chosen, ...) and the plan over pairs.
    """
    if pair_ratio < 1:
        raise ValueError(f"the pair ratio is a ratio of pair counts, >= 1; got {pair_ratio}")
    n_long = max(1, round(pairs_per_microbatch / pair_ratio))
    long_length = round(short_length * pairs_per_microbatch / n_long)
    counts = [n_long] + [pairs_per_microbatch] * (world_size * accum_steps - 1)
    lengths = [long_length] * (2 * n_long) + [short_length] * (2 * (sum(counts) - n_long))
    bounds = np.concatenate([[0], np.cumsum(counts)])
    microbatches = [torch.arange(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    plan = [microbatches[r * accum_steps:(r + 1) * accum_steps] for r in range(world_size)]
    return tuple(lengths), plan


def _longest_pair_response(pair_ratios: Sequence[float], pairs_per_microbatch: int, short_length: int) -> int:
    """The longest response ``packed_pairs`` makes over ``pair_ratios``: one problem size fits them all."""
    return max(round(short_length * pairs_per_microbatch / max(1, round(pairs_per_microbatch / k)))
               for k in pair_ratios)


def dpo_sweep(
    pair_ratios: Sequence[float], world_size: int = 2, accum_steps: int = 2, pairs_per_microbatch: int = 8,
    short_length: int = 6, seed: int = 0,
) -> GradientSweep:
    """DPO's gradient under ``local`` and ``pair`` against the full batch, for ``packed_pairs``.

    pair ratio = pairs in a full microbatch / pairs in the microbatch of long pairs. At pair ratio 1
    every microbatch holds the same number of pairs and the mean of means is exact (the control).
    ``microbatch_tokens`` counts pairs here (``unit``).
    """
    rel = {m: [] for m in DPO_MODES}
    cos = {m: [] for m in DPO_MODES}
    pairs_per_mb = []
    max_len = _longest_pair_response(pair_ratios, pairs_per_microbatch, short_length)
    for k in pair_ratios:
        lengths, plan = packed_pairs(k, world_size, accum_steps, pairs_per_microbatch, short_length)
        pairs_per_mb.append([[len(mb) for mb in rank] for rank in plan])
        for m in DPO_MODES:
            r, c = compare(dpo_gradient(lengths, m, plan, seed, max_len), dpo_gradient(lengths, m, None, seed, max_len))
            rel[m].append(r)
            cos[m].append(c)
    return GradientSweep(
        shard="token budget", world_size=world_size, accum_steps=accum_steps,
        x=np.asarray(pair_ratios, dtype=float), microbatch_tokens=np.array(pairs_per_mb),
        relative_error={m: np.array(v) for m, v in rel.items()}, cosine={m: np.array(v) for m, v in cos.items()},
        unit="pairs", loss="dpo",
    )


@dataclass(frozen=True)
class LongPairs:
    """Why ``local``'s cosine need not fall steadily with the pair ratio (notebook 05).

    Under ``packed_pairs`` both gradients mix the same two vectors: u, the mean gradient of a long
    pair (rank 0's first microbatch), and s, the mean gradient of a short pair.
    ``local`` gives the long pairs 1/(W A) of the update, the full batch their share of the pairs
    n/P, so g = a u + (1 - a) s with a = ``share_local`` or ``share_full``. Their cosine is set by
    those shares, and by the length ratio |u| / |s| and the angle between u and s, which belong to
    the pairs drawn at each ratio, not to the ratio.
    """

    x: np.ndarray  # (K,) pair ratios
    share_full: np.ndarray  # (K,) n / P: the long pairs' share of the pairs, their weight in the full batch
    share_local: np.ndarray  # (K,) 1 / (W A): their weight under local
    norm_ratio: np.ndarray  # (K,) |u| / |s|
    cosine_long_short: np.ndarray  # (K,) cos(u, s)

    def predicted_cosine(self) -> np.ndarray:
        """cos(g_local, g_full) from the two shares, |u| / |s| and cos(u, s) alone."""
        r, c = self.norm_ratio, self.cosine_long_short

        def dot(a, b):  # (a u + (1 - a) s) . (b u + (1 - b) s), in units of |s|^2
            return a * b * r * r + (a * (1 - b) + b * (1 - a)) * r * c + (1 - a) * (1 - b)

        a, b = self.share_local, self.share_full
        return dot(a, b) / np.sqrt(dot(a, a) * dot(b, b))


def long_pairs(
    pair_ratios: Sequence[float], world_size: int = 2, accum_steps: int = 2, pairs_per_microbatch: int = 8,
    short_length: int = 6, seed: int = 0,
) -> LongPairs:
    """``LongPairs`` for ``packed_pairs`` at each pair ratio, on the policy and pairs ``dpo_sweep`` uses."""
    max_len = _longest_pair_response(pair_ratios, pairs_per_microbatch, short_length)
    rows = []
    for k in pair_ratios:
        lengths, plan = packed_pairs(k, world_size, accum_steps, pairs_per_microbatch, short_length)
        problem = make_problem(lengths=lengths, group_size=2, max_len=max_len, seed=seed)
        policy = make_policy(seed)
        params = list(policy.parameters())
        long = plan[0][0]
        short = torch.cat([torch.cat(rank) for rank in plan])[len(long):]
        u, s = (_flat(torch.autograd.grad(dpo_pair_losses(policy, problem, idx).mean(), params)) for idx in (long, short))
        num_pairs = len(long) + len(short)
        rows.append((len(long) / num_pairs, 1 / (world_size * accum_steps), float(u.norm() / s.norm()),
                     float(torch.dot(u, s) / (u.norm() * s.norm()))))
    full, local, ratio, cosine = (np.array(col) for col in zip(*rows))
    return LongPairs(np.asarray(pair_ratios, dtype=float), full, local, ratio, cosine)
