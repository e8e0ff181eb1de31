"""The numbers behind the notebooks and figures: pure functions that return data, never draw.

Every view of the bug is built from the library's own arithmetic, never re-derived here:
per-token weights come from ``simulate.effective_weights``, gradients from
``simulate.simulated_gradient`` on ``toy``'s policy and GRPO minibatch, advantages from
``grpo.group_advantages``. Modes are named by strings everywhere in this module:

    "local", "token", "sequence", "group"   the modes of ``gradnorm.denominators``
    "constant"                              Dr GRPO's C = S * max_new_tokens (``dr_grpo_constant``)

Three families of views:

1. Token imbalance without a model (notebook 01): ``imbalanced_minibatch`` lays out a minibatch
   with one short microbatch, ``token_layout`` gives each sequence's per-token weight,
   ``rank_shares`` each rank's share of the update against its share of the tokens.
2. Real gradients (notebook 02): ``gradient_sweep`` measures each mode's gradient against the
   full-batch gradient as ``ragged_lengths`` grow more ragged; ``ddp_check`` repeats one point on
   real gloo processes.
3. Length bias (notebook 04): ``length_weights``, ``correct_vs_wrong`` and ``batch_dependence``
   show how each denominator weighs long against short and correct against wrong responses.
4. The same mistake elsewhere (notebook 05): ``gradient_sweep(..., loss="sft")`` for SFT
   cross-entropy, ``dpo_sweep`` for DPO's mean over preference pairs.
5. Training under imbalance (notebook 03): ``train_run`` launches the real trainer
   (``torchrun gradnorm/train.py``) and reads its ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gradnorm.denominators import Denominator
from gradnorm.dist.harness import Case, run_ddp
from gradnorm.toy import Problem, make_policy, make_problem, token_logp, token_losses
from gradnorm.grpo import group_advantages
from gradnorm.sharding import Plan, contiguous, make_plan
from gradnorm.simulate import effective_weights, simulated_gradient

MODE_NAMES: tuple[str, ...] = ("local", "token", "sequence", "group", "constant")
INVARIANT_MODES: tuple[str, ...] = ("token", "sequence", "group", "constant")
# Who uses which denominator (papers by name; see DESIGN.md "Facts from the field").
PAPER_OF_MODE = {
    "sequence": "DeepSeekMath GRPO",
    "token": "DAPO",
    "constant": "Dr GRPO",
    "group": "per-prompt mean",
    "local": "per-microbatch mean (the bug)",
}


def dr_grpo_constant(num_sequences: int, max_new_tokens: int) -> float:
    """Dr GRPO's constant denominator C = S * max_new_tokens: the most tokens S responses can hold."""
    return float(num_sequences * max_new_tokens)


def resolve(mode: str, num_sequences: int, max_new_tokens: int) -> Denominator:
    """A mode name of this module -> the denominator ``gradnorm.denominators`` takes."""
    if mode == "constant":
        return dr_grpo_constant(num_sequences, max_new_tokens)
    if mode not in MODE_NAMES:
        raise ValueError(f"unknown mode {mode!r}: expected one of {', '.join(MODE_NAMES)}")
    return mode


def response_mask(lengths: Tensor, max_len: int | None = None) -> Tensor:
    """M (S, T): True on the first |o_i| positions of each row."""
    max_len = int(lengths.max()) if max_len is None else max_len
    return torch.arange(max(max_len, 1)) < lengths.unsqueeze(-1)


# ---------------------------------------------------------------------------------------------
# 1. Token imbalance without a model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Minibatch:
    """A minibatch of response lengths laid out over W ranks x A microbatches."""

    lengths: Tensor  # (S,) |o_i|, int64
    group_ids: Tensor  # (S,) prompt group of each sequence
    num_groups: int
    plan: Plan  # plan[r][m]: sequence indices of rank r's microbatch m

    @property
    def mask(self) -> Tensor:  # (S, T) bool
        return response_mask(self.lengths)

    @property
    def world_size(self) -> int:
        return len(self.plan)

    @property
    def accum_steps(self) -> int:
        return len(self.plan[0])

    def microbatch_tokens(self) -> np.ndarray:
        """N[r, m] (W, A): response tokens in rank r's microbatch m."""
        return np.array([[int(self.lengths[mb].sum()) for mb in rank] for rank in self.plan])


def imbalanced_minibatch(
    world_size: int = 2,
    accum_steps: int = 2,
    imbalance: float = 4.0,
    seqs_per_microbatch: int = 2,
    full_length: int = 12,
) -> Minibatch:
    """Every microbatch full, except rank 0's first, whose tokens are ``imbalance`` times fewer.

    Each microbatch holds ``seqs_per_microbatch`` sequences (one prompt group) of ``full_length``
    response tokens; the sequences of rank 0's first microbatch have
    max(1, round(full_length / imbalance)) tokens. imbalance = 1 is perfectly balanced.
    """
    if imbalance < 1:
        raise ValueError(f"imbalance is a ratio of token counts, >= 1; got {imbalance}")
    num_sequences = world_size * accum_steps * seqs_per_microbatch
    short_length = max(1, round(full_length / imbalance))
    lengths = torch.full((num_sequences,), full_length, dtype=torch.int64)
    lengths[:seqs_per_microbatch] = short_length  # contiguous sharding puts these on rank 0, mb 0
    return Minibatch(
        lengths=lengths,
        group_ids=torch.arange(num_sequences) // seqs_per_microbatch,
        num_groups=world_size * accum_steps,
        plan=contiguous(lengths, world_size, accum_steps),
    )


def worked_example_minibatch() -> Minibatch:
    """The seed example of ``gradnorm.worked_example``: 2 ranks x 2 microbatches, tokens 3, 14 | 12, 12."""
    from gradnorm import worked_example as ex

    return Minibatch(lengths=ex.LENGTHS.clone(), group_ids=ex.GROUPS.clone(), num_groups=2, plan=ex.PLAN)


@dataclass(frozen=True)
class Layout:
    """Every sequence of a minibatch in plan order (rank by rank, microbatch by microbatch)."""

    sequence: np.ndarray  # (S,) index of the sequence in the minibatch
    rank: np.ndarray  # (S,) r
    microbatch: np.ndarray  # (S,) m
    length: np.ndarray  # (S,) |o_i|
    left: np.ndarray  # (S,) tokens laid out before this sequence
    weight: np.ndarray  # (S,) w: the weight of each of its tokens in J (one value per sequence)

    @property
    def total(self) -> np.ndarray:
        """|o_i| * w: the sequence's total weight in J."""
        return self.length * self.weight


def token_layout(batch: Minibatch, mode: str, max_new_tokens: int | None = None) -> Layout:
    """Per-token weight of every sequence under ``mode`` and ``batch.plan``.

    Within a sequence every mode gives all tokens the same weight, so one number per sequence
    says it all; a bar of width |o_i| and height w has the sequence's total weight as its area.
    """
    max_new_tokens = int(batch.lengths.max()) if max_new_tokens is None else max_new_tokens
    denominator = resolve(mode, len(batch.lengths), max_new_tokens)
    mask = batch.mask
    w = effective_weights(mask, batch.group_ids, batch.num_groups, denominator, batch.plan)  # (S, T)
    order, ranks, mbs = [], [], []
    for r, rank in enumerate(batch.plan):
        for m, mb in enumerate(rank):
            order += mb.tolist()
            ranks += [r] * len(mb)
            mbs += [m] * len(mb)
    order_t = torch.tensor(order, dtype=torch.long)
    length = batch.lengths[order_t].numpy()
    per_token = w[order_t].max(-1).values.numpy()  # the one nonzero value of each row (0 if empty)
    return Layout(
        sequence=np.array(order), rank=np.array(ranks), microbatch=np.array(mbs), length=length,
        left=np.concatenate([[0], np.cumsum(length)[:-1]]), weight=per_token,
    )


@dataclass(frozen=True)
class RankShares:
    """Each rank's share of the update next to its share of the response tokens."""

    update: np.ndarray  # (W,) sum of rank r's token weights / sum of all token weights
    tokens: np.ndarray  # (W,) tokens on rank r / N


def rank_shares(mask: Tensor, group_ids: Tensor, num_groups: int, denominator: Denominator, plan: Plan) -> RankShares:
    """How much of the update each rank's tokens carry, and how many of the tokens it holds.

    The update is J = sum w * l * M, so rank r's share of it is the sum of its tokens' weights
    over the sum of all weights (for a constant C that sum is N/C, not 1, hence the ratio).
    Invariant token-mean modes give every rank exactly its share of the tokens; ``local`` gives
    every rank with tokens in all its microbatches 1/W, whatever it holds.
    """
    w = effective_weights(mask, group_ids, num_groups, denominator, plan)  # (S, T)
    rank_idx = [torch.cat(rank) for rank in plan]
    weight = np.array([float(w[idx].sum()) for idx in rank_idx])
    tokens = np.array([float(mask[idx].sum()) for idx in rank_idx])
    return RankShares(update=_normalize(weight), tokens=_normalize(tokens))


def batch_rank_shares(batch: Minibatch, mode: str) -> RankShares:
    """``rank_shares`` of a ``Minibatch`` under a mode name."""
    denominator = resolve(mode, len(batch.lengths), int(batch.lengths.max()))
    return rank_shares(batch.mask, batch.group_ids, batch.num_groups, denominator, batch.plan)


def _normalize(x: np.ndarray) -> np.ndarray:
    total = x.sum()
    return x / total if total > 0 else np.zeros_like(x)


def weight_ratio(layout: Layout) -> float:
    """Largest over smallest per-token weight among tokens that exist: 1 means all tokens equal."""
    w = layout.weight[layout.length > 0]
    return float(w.max() / w.min()) if len(w) else 1.0


@dataclass(frozen=True)
class ShareSweep:
    """Rank 0's share of the update under each mode, and of the tokens, as the imbalance grows."""

    imbalance: np.ndarray  # (K,)
    token_share: np.ndarray  # (K,) rank 0's share of the tokens
    update_share: dict[str, np.ndarray]  # mode -> (K,) rank 0's share of the update


def share_sweep(
    imbalances: Sequence[float], world_size: int = 2, accum_steps: int = 2, modes: Sequence[str] = ("local", "token"),
    **minibatch_kwargs,
) -> ShareSweep:
    """Rank 0's shares over ``imbalanced_minibatch(world_size, accum_steps, imbalance)`` for each imbalance."""
    batches = [imbalanced_minibatch(world_size, accum_steps, k, **minibatch_kwargs) for k in imbalances]
    return ShareSweep(
        imbalance=np.asarray(imbalances, dtype=float),
        token_share=np.array([batch_rank_shares(b, "token").tokens[0] for b in batches]),
        update_share={m: np.array([batch_rank_shares(b, m).update[0] for b in batches]) for m in modes},
    )


# ---------------------------------------------------------------------------------------------
# 2. Real gradients: a policy, a ragged GRPO minibatch, every mode against the full batch
# ---------------------------------------------------------------------------------------------

MAX_LEN = 12  # harness.run_ddp's workers build make_problem with its default max_len = 12
GROUP_SIZE = 4  # ... and its default group size


def ragged_lengths(imbalance: float, num_sequences: int = 32, max_len: int = MAX_LEN, seed: int = 0) -> tuple[int, ...]:
    """Response lengths spread log-uniformly from max_len / imbalance to max_len.

    The same seeded draw u_i in [0, 1) serves every imbalance: |o_i| = round(max_len * imbalance^-u_i),
    at least 1. imbalance = 1 makes every response max_len long; larger values make them ragged
    (longest / shortest about ``imbalance``) while keeping the same order.
    """
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(num_sequences, generator=g, dtype=torch.float64)
    lengths = torch.round(max_len * imbalance ** (-u)).clamp(min=1, max=max_len)
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
    imbalance: np.ndarray  # (K,) the ``ragged_lengths`` parameter
    microbatch_tokens: np.ndarray  # (K, W, A) N[r, m] under the sharding (DPO: pairs, see ``unit``)
    relative_error: dict[str, np.ndarray]  # mode -> (K,)
    cosine: dict[str, np.ndarray]  # mode -> (K,)
    unit: str = "tokens"  # what microbatch_tokens counts


def gradient_sweep(
    imbalances: Sequence[float],
    modes: Sequence[str] = MODE_NAMES,
    shard: str = "length",
    world_size: int = 2,
    accum_steps: int = 2,
    num_sequences: int = 32,
    seed: int = 0,
    loss: str = "grpo",
) -> GradientSweep:
    """For each imbalance and mode: shard the minibatch, simulate W ranks x A microbatches, and
    compare the gradient with the same mode's full-batch gradient (W = A = 1).

    The full-batch gradient of ``local`` is the token mean's (one microbatch: one local mean), so
    ``local``'s error is its distance from the fix; the other modes' errors are rounding.
    """
    rel = {m: [] for m in modes}
    cos = {m: [] for m in modes}
    tokens = []
    for k in imbalances:
        lengths = ragged_lengths(k, num_sequences, seed=seed)
        plan = make_plan(shard, torch.tensor(lengths), world_size, accum_steps)
        tokens.append([[sum(lengths[i] for i in mb.tolist()) for mb in rank] for rank in plan])
        for m in modes:
            r, c = compare(policy_gradient(lengths, m, plan, seed, loss), policy_gradient(lengths, m, None, seed, loss))
            rel[m].append(r)
            cos[m].append(c)
    return GradientSweep(
        shard=shard, world_size=world_size, accum_steps=accum_steps, imbalance=np.asarray(imbalances, dtype=float),
        microbatch_tokens=np.array(tokens), relative_error={m: np.array(v) for m, v in rel.items()},
        cosine={m: np.array(v) for m, v in cos.items()},
    )


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


# ---------------------------------------------------------------------------------------------
# 3. Length bias: how each denominator weighs long against short, correct against wrong
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthWeights:
    """One minibatch on one rank: each sequence's per-token weight and total weight per mode."""

    lengths: np.ndarray  # (S,)
    group_ids: np.ndarray  # (S,)
    max_new_tokens: int
    token_weight: dict[str, np.ndarray]  # mode -> (S,) w of each of the sequence's tokens
    total_weight: dict[str, np.ndarray]  # mode -> (S,) |o_i| * w: the sequence's weight in J

    def share(self, mode: str) -> np.ndarray:
        """(S,) each sequence's share of the update (total weights normalized to sum 1)."""
        return _normalize(self.total_weight[mode])

    def group_share(self, mode: str) -> np.ndarray:
        """(G,) each prompt group's share of the update."""
        return np.bincount(self.group_ids, weights=self.share(mode))


def staircase_lengths(num_groups: int = 4, group_size: int = 4, step: int = 4) -> list[int]:
    """Prompt g's responses have (g+1) * step * (1, 2, ..., group_size) tokens: short and long
    responses within every prompt, and prompts whose responses are longer overall."""
    return [(g + 1) * step * (i + 1) for g in range(num_groups) for i in range(group_size)]


def length_weights(
    lengths: Sequence[int], group_size: int, modes: Sequence[str] = INVARIANT_MODES, max_new_tokens: int | None = None
) -> LengthWeights:
    """Per-token and per-sequence weights of every mode for one minibatch (W = A = 1).

    Sequences come in consecutive prompt groups of ``group_size``. ``max_new_tokens`` sets Dr
    GRPO's constant (default: the longest response).
    """
    lengths_t = torch.as_tensor(lengths, dtype=torch.int64)
    max_new_tokens = int(lengths_t.max()) if max_new_tokens is None else max_new_tokens
    batch = Minibatch(lengths_t, torch.arange(len(lengths_t)) // group_size,
                      -(-len(lengths_t) // group_size), [[torch.arange(len(lengths_t))]])
    per_token = {m: _by_sequence(token_layout(batch, m, max_new_tokens)) for m in modes}
    length = lengths_t.numpy()
    return LengthWeights(
        lengths=length, group_ids=batch.group_ids.numpy(), max_new_tokens=max_new_tokens,
        token_weight=per_token, total_weight={m: w * length for m, w in per_token.items()},
    )


def _by_sequence(layout: Layout) -> np.ndarray:
    out = np.zeros(len(layout.sequence))
    out[layout.sequence] = layout.weight
    return out


@dataclass(frozen=True)
class CorrectVsWrong:
    """One prompt group: k correct responses of one length, G - k wrong ones of another.

    With the importance ratio at 1 (first step on fresh samples) the GRPO gradient raises the
    log-prob of each token of response i by w_i * A_i: its *push*. Correct responses have A > 0
    (pushed up), wrong ones A < 0 (pushed down).
    """

    correct_len: int
    wrong_len: int
    num_correct: int
    group_size: int
    advantage_correct: float
    advantage_wrong: float
    push_per_token: dict[str, tuple[float, float]]  # mode -> (correct token, wrong token), in units of 1/N
    update_share: dict[str, tuple[float, float]]  # mode -> share of sum |push| on (correct, wrong) responses


def correct_vs_wrong(
    correct_len: int, wrong_len: int, num_correct: int = 4, group_size: int = 8,
    modes: Sequence[str] = INVARIANT_MODES, max_new_tokens: int = 64, scale_by_std: bool = True,
) -> CorrectVsWrong:
    """The push on a correct and on a wrong token under each mode, and how |push| splits.

    Pushes are reported in units of 1/N (multiplied by the minibatch's token count), the token
    mode's weight, so that ``token`` reads as the bare advantages and the other modes as how far
    they depart from it.
    """
    if not 0 < num_correct < group_size:
        raise ValueError(f"need 0 < num_correct < group_size, got {num_correct} of {group_size}")
    if max(correct_len, wrong_len) > max_new_tokens:
        raise ValueError(f"responses cannot be longer than max_new_tokens = {max_new_tokens}")
    lengths = [correct_len] * num_correct + [wrong_len] * (group_size - num_correct)
    rewards = torch.tensor([1.0] * num_correct + [0.0] * (group_size - num_correct), dtype=torch.float64)
    adv = group_advantages(rewards, group_size, scale_by_std=scale_by_std).numpy()  # (G,)
    view = length_weights(lengths, group_size, modes, max_new_tokens)
    tokens = sum(lengths)
    push, share = {}, {}
    for m in modes:
        w = view.token_weight[m]
        push[m] = (float(w[0] * adv[0] * tokens), float(w[-1] * adv[-1] * tokens))
        total = np.abs(view.total_weight[m] * adv)
        s = _normalize(np.array([total[:num_correct].sum(), total[num_correct:].sum()]))
        share[m] = (float(s[0]), float(s[1]))
    return CorrectVsWrong(
        correct_len=correct_len, wrong_len=wrong_len, num_correct=num_correct, group_size=group_size,
        advantage_correct=float(adv[0]), advantage_wrong=float(adv[-1]), push_per_token=push, update_share=share,
    )


@dataclass(frozen=True)
class BatchDependence:
    """The per-token weight of one fixed response as the rest of its minibatch grows longer."""

    own_length: int
    other_length: np.ndarray  # (K,) the length of every other response of the minibatch
    token_weight: dict[str, np.ndarray]  # mode -> (K,) the fixed response's per-token weight


def batch_dependence(
    other_lengths: Sequence[int], own_length: int = 16, num_sequences: int = 16, group_size: int = 4,
    modes: Sequence[str] = INVARIANT_MODES, max_new_tokens: int = 64,
) -> BatchDependence:
    """Sequence 0 keeps ``own_length`` tokens while every other response has ``other_length``.

    Under ``token`` its tokens weigh 1/N, so they count less when the *other* responses are long;
    under ``group`` only its own group matters; ``sequence`` and a constant ignore the others.
    """
    weights = {m: [] for m in modes}
    for other in other_lengths:
        lengths = [own_length] + [int(other)] * (num_sequences - 1)
        view = length_weights(lengths, group_size, modes, max_new_tokens)
        for m in modes:
            weights[m].append(view.token_weight[m][0])
    return BatchDependence(own_length=own_length, other_length=np.asarray(other_lengths),
                           token_weight={m: np.array(v) for m, v in weights.items()})


# ---------------------------------------------------------------------------------------------
# 4. The same mistake elsewhere: DPO's mean over preference pairs
# ---------------------------------------------------------------------------------------------

DPO_MODES = {"local": "local", "global": "token"}  # a pair is one unit: its "token" mean is the mean over pairs
DPO_MAX_LEN = 64  # longer responses than the GRPO minibatch's, so that token packing moves pairs around


def dpo_pair_losses(policy: torch.nn.Module, problem: Problem, pairs: Tensor, beta: float = 0.1) -> Tensor:
    """DPO's loss of each preference pair, (n, 1): -log sigmoid(beta * (margin_chosen - margin_rejected)).

    Pair p is the chosen response 2p and the rejected response 2p + 1 of ``problem``; a response's
    margin is its summed log-prob under the policy minus under the reference, over its mask.
    """
    chosen, rejected = 2 * pairs, 2 * pairs + 1
    both = torch.cat([chosen, rejected])
    logp = token_logp(policy, problem.inputs[both], problem.targets[both])  # (2n, T)
    margin = torch.where(problem.mask[both], logp - problem.ref_logp[both], 0.0).sum(-1)  # (2n,)
    n = len(pairs)
    return -F.logsigmoid(beta * (margin[:n] - margin[n:])).unsqueeze(-1)


def dpo_gradient(lengths: Sequence[int], mode: str, plan: Plan | None = None, seed: int = 0,
                 max_len: int = DPO_MAX_LEN) -> Tensor:
    """The flat gradient of one DPO step over the pairs of ``lengths`` (chosen, rejected, ...).

    Each pair enters ``simulate.simulated_gradient`` as a one-token "sequence" whose loss is the
    pair's loss, so ``local`` is the per-microbatch mean over pairs and ``global`` (``token``) the
    mean over every pair of the minibatch. ``plan`` assigns pairs to ranks and microbatches.
    """
    problem = make_problem(lengths=lengths, group_size=2, max_len=max_len, seed=seed)
    policy = make_policy(seed)
    num_pairs = len(lengths) // 2
    plan = [[torch.arange(num_pairs)]] if plan is None else plan
    pair_mask = torch.ones(num_pairs, 1, dtype=torch.bool)  # one unit per pair
    grads = simulated_gradient(lambda idx: dpo_pair_losses(policy, problem, idx), list(policy.parameters()),
                               pair_mask, torch.arange(num_pairs), num_pairs, DPO_MODES[mode], plan)
    return _flat(grads)


def packed_pairs(
    imbalance: float, world_size: int = 2, accum_steps: int = 2, pairs_per_microbatch: int = 8, short_length: int = 6,
) -> tuple[tuple[int, ...], Plan]:
    """Preference pairs packed under one token budget per microbatch: long pairs, fewer per microbatch.

    Every microbatch holds the same tokens, 2 * short_length * pairs_per_microbatch. Rank 0's
    first one holds n = max(1, round(pairs_per_microbatch / imbalance)) long pairs (responses of
    short_length * pairs_per_microbatch / n tokens); every other one holds pairs_per_microbatch
    short pairs. Returns the response lengths (chosen, rejected, chosen, ...) and the plan over pairs.
    """
    if imbalance < 1:
        raise ValueError(f"imbalance is a ratio of pair counts, >= 1; got {imbalance}")
    n_long = max(1, round(pairs_per_microbatch / imbalance))
    long_length = round(short_length * pairs_per_microbatch / n_long)
    counts = [n_long] + [pairs_per_microbatch] * (world_size * accum_steps - 1)
    lengths = [long_length] * (2 * n_long) + [short_length] * (2 * (sum(counts) - n_long))
    bounds = np.concatenate([[0], np.cumsum(counts)])
    microbatches = [torch.arange(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    plan = [microbatches[r * accum_steps:(r + 1) * accum_steps] for r in range(world_size)]
    return tuple(lengths), plan


def pairs_as_minibatch(plan: Plan) -> Minibatch:
    """A plan over preference pairs as a ``Minibatch`` of one-token sequences: each pair one unit,
    so ``token_layout`` and ``rank_shares`` give each pair's weight and each rank's share."""
    num_pairs = sum(len(mb) for rank in plan for mb in rank)
    return Minibatch(torch.ones(num_pairs, dtype=torch.int64), torch.arange(num_pairs), num_pairs, plan)


def dpo_sweep(
    imbalances: Sequence[float], world_size: int = 2, accum_steps: int = 2, pairs_per_microbatch: int = 8,
    short_length: int = 6, seed: int = 0,
) -> GradientSweep:
    """DPO's gradient under ``local`` and ``global`` against the full batch, for ``packed_pairs``.

    imbalance = pairs in a full microbatch / pairs in the microbatch of long pairs. At imbalance 1
    every microbatch holds the same number of pairs and the mean of means is exact (the control).
    ``microbatch_tokens`` counts pairs here (``unit``).
    """
    rel = {m: [] for m in DPO_MODES}
    cos = {m: [] for m in DPO_MODES}
    pairs_per_mb = []
    max_len = max(round(short_length * pairs_per_microbatch / max(1, round(pairs_per_microbatch / k)))
                  for k in imbalances)
    for k in imbalances:
        lengths, plan = packed_pairs(k, world_size, accum_steps, pairs_per_microbatch, short_length)
        pairs_per_mb.append([[len(mb) for mb in rank] for rank in plan])
        for m in DPO_MODES:
            r, c = compare(dpo_gradient(lengths, m, plan, seed, max_len), dpo_gradient(lengths, m, None, seed, max_len))
            rel[m].append(r)
            cos[m].append(c)
    return GradientSweep(
        shard="token budget", world_size=world_size, accum_steps=accum_steps,
        imbalance=np.asarray(imbalances, dtype=float), microbatch_tokens=np.array(pairs_per_mb),
        relative_error={m: np.array(v) for m, v in rel.items()}, cosine={m: np.array(v) for m, v in cos.items()},
        unit="pairs",
    )


# ---------------------------------------------------------------------------------------------
# 5. Training under imbalance: short runs of the real trainer
# ---------------------------------------------------------------------------------------------

TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"


@dataclass(frozen=True)
class TrainingRun:
    """One run of ``gradnorm/train.py``: its settings and the rows of its metrics.jsonl."""

    label: str
    loss_denominator: str
    shard: str
    output_dir: Path
    metrics: list[dict]  # one dict per optimizer step
    wall_s: float  # the whole run, warm-up and process start included

    def series(self, key: str) -> np.ndarray:
        """(steps,) one logged value per optimizer step."""
        return np.array([row[key] for row in self.metrics], dtype=float)

    @property
    def steps(self) -> np.ndarray:
        return self.series("step")

    def rank_token_share(self, rank: int = 0) -> np.ndarray:
        """(steps,) the share of each step's response tokens that ``rank`` held."""
        return np.array([row["tokens_per_rank"][rank] / max(row["tokens"], 1) for row in self.metrics])


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_run(
    output_dir: str | Path,
    loss_denominator: str = "token",
    shard: str = "length",
    grad_accum_steps: int = 2,
    nproc_per_node: int = 2,
    steps: int = 30,
    seed: int = 0,
    extra_args: Sequence[str] = ("--no-plot", "--save-every", "0"),
    label: str | None = None,
    timeout_s: float = 1800,
) -> TrainingRun:
    """Run ``torchrun --standalone --nproc_per_node=W gradnorm/train.py`` with these flags and read its metrics.

    Each process runs with OMP_NUM_THREADS=1 (the trainer's processes share the cores). The run
    writes into ``output_dir``; a failure raises with the tail of the trainer's output.
    """
    output_dir = Path(output_dir)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}",
        str(TRAIN_SCRIPT), "--loss-denominator", str(loss_denominator), "--shard", shard,
        "--grad-accum-steps", str(grad_accum_steps), "--steps", str(steps), "--seed", str(seed),
        "--output-dir", str(output_dir), *extra_args,
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"the trainer failed (exit {done.returncode}): {' '.join(cmd)}\n{tail}")
    return load_run(output_dir, label, wall_s=time.perf_counter() - start)


def load_run(output_dir: str | Path, label: str | None = None, wall_s: float = float("nan")) -> TrainingRun:
    """A finished run from its output directory (config.json and metrics.jsonl)."""
    output_dir = Path(output_dir)
    config = json.loads((output_dir / "config.json").read_text())
    denominator, shard = str(config["loss_denominator"]), str(config["shard"])
    return TrainingRun(label=label or f"{denominator}, {shard}", loss_denominator=denominator, shard=shard,
                       output_dir=output_dir, metrics=read_jsonl(output_dir / "metrics.jsonl"), wall_s=wall_s)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last ``window`` values at each step (fewer at the start): a trailing average."""
    values = np.asarray(values, dtype=float)
    sums = np.cumsum(np.concatenate([[0.0], values]))
    k = np.arange(1, len(values) + 1)
    lo = np.maximum(k - window, 0)
    return (sums[k] - sums[lo]) / (k - lo)


def shared_rollout_steps(a: TrainingRun, b: TrainingRun) -> int:
    """How many leading steps two runs sampled bit-identical rollouts (the trainer logs a digest)."""
    n = 0
    for row_a, row_b in zip(a.metrics, b.metrics):
        if row_a.get("rollout_digest") is None or row_a.get("rollout_digest") != row_b.get("rollout_digest"):
            break
        n += 1
    return n
