"""Does my trainer have this bug? Measure the effective token weights of any microbatch loss.

    python -m gradnorm.audit package.module:function --world-size 8 --accum-steps 4
    python -m gradnorm.audit my_loss.py:function --sharding length balanced --scale-by-accum

Method. The per-token log-probs are a leaf tensor. The user's microbatch loss runs under a
simulated (W, A, sharding): the trainer's accumulation convention (backward as returned, or
divided by A), gradients added over a rank's microbatches, then DDP's mean (or sum) over ranks,
the arithmetic of ``gradnorm.core.simulate``. On policy (old_logp = ref_logp = logp, so rho = 1, the
clip is inactive and a k2/k3 KL has zero gradient) the surrogate -rho * A_i has derivative -A_i,
so the reduced gradient g of one optimizer step gives each token's weight in J exactly:

    g[i, t] = -A_i * w[i, t]      =>      w[i, t] = -(g(+A) - g(-A))[i, t] / (2 * A_i)

Running with both signs of the advantages cancels any gradient that does not scale with them (a
k1 KL, an entropy bonus); its size is reported as ``residual``. No line of the loss is read.

Diagnosis. Against the reference (one process, one microbatch) and gradnorm's modes, a Report
also says why a loss fails:

    wrong sign      some w[i, t] < 0 with M[i, t] = 1: the loss rises where A_i > 0
    up to a factor  w = c * w_mode under every configuration, c = k * W^p * A^q (``Near``)
    unequal counts  invariant on every plan whose microbatches hold equal numbers of sequences,
                    skewed on a plan whose microbatches do not (``balanced`` packs by tokens)

and it refuses (``ContractError``) a run whose only configuration is the reference.

The contract of ``loss_fn(logp, old_logp, advantages, mask, **asked)`` -> a scalar tensor, the
loss of one microbatch of n sequences: ``logp`` (n, T) float64, the leaf; ``old_logp`` (n, T);
``advantages`` (n,); ``mask`` (n, T) bool, the response tokens. Only the keywords it names in
its signature are passed (``COUNTS``): the global counts a fixed trainer all-reduces.

This module is pure (no torch.distributed, no processes): ``audit`` returns a ``Report``;
``gradnorm.audit.cli`` is the command and ``gradnorm.audit.plot`` draws the weights.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import itertools
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from gradnorm.audit.masking import MaskedFinding, finding as masked_finding, with_masked_tokens
from gradnorm.audit.splits import Layout, Loop, Splits, build, layouts
from gradnorm.core.grpo import group_advantages
from gradnorm.core.modes import MODE_NAMES
from gradnorm.core.sharding import SHARD_KINDS, Plan, validate_plan
from gradnorm.core.simulate import effective_weights, simulated_counts

COUNTS = {
    "ref_logp": "(n, T) reference log-probs; equal to logp here, so a k2/k3 KL has zero gradient",
    "num_tokens": "N: response tokens of the whole minibatch (all ranks, all microbatches) the loss should count",
    "num_sequences": "S_tok: sequences of the minibatch with at least one response token",
    "num_groups": "N_groups: prompt groups of the minibatch with at least one response token",
    "group_tokens": "(k,) int64: N_g(i), the minibatch's token count of each sequence's group",
    "group_ids": "(k,) int64: the global prompt-group index of each sequence",
    "world_size": "W: data-parallel ranks",
    "accum_steps": "A: this rank's microbatches per optimizer step (under a token budget, each rank's own)",
    "sequence_ids": "(n, T) int64: which of the call's k sequences each position belongs to (-1: a packed "
                    "row's padding); row i is sequence i unless rows are packed",
    "sequence_tokens": "(k,) int64: |o_i|, the tokens of each sequence the loss should count (all its chunks)",
    "num_response_tokens": "every generated token of the minibatch, dropped ones included",
    "truncated": "(k,) bool: responses cut at max_new_tokens",
    "rejected": "(n, T) bool: tokens a rejection (importance-sampling) mask drops",
    "context_parallel": "K: ranks each sequence is split over (1 without context parallelism)",
    "pipeline_microbatches": "P: pipeline microbatches a microbatch is cut into (1 without a pipeline)",
}
MODES = MODE_NAMES  # compared in this order: the core's modes, then Dr GRPO's constant


class ContractError(ValueError):
    """The loss cannot be audited: unimportable, or it breaks the contract. One line, no traceback."""


@dataclass(frozen=True)
class SyntheticBatch:
    """The synthetic ragged GRPO minibatch every loss is audited on (S sequences, T positions)."""

    logp: Tensor  # (S, T) float64, also on padding, where a loss that ignores the mask reads it
    mask: Tensor  # (S, T) bool, the tokens the loss should count (the first |o_i| positions of each row)
    advantages: Tensor  # (S,) float64, |A_i| >= 0.1, both signs in every group
    group_ids: Tensor  # (S,) int64, consecutive groups of group_size completions
    group_size: int
    response: Tensor | None = None  # (S, T) bool, every generated token (``mask`` unless tokens are dropped)
    truncated: Tensor | None = None  # (S,) bool, responses cut at T (``gradnorm.audit.masking``)
    rejected: Tensor | None = None  # (S, T) bool, tokens a rejection mask drops
    count_masked: str | None = None  # which of those the loss should count; None: the batch has none

    def __post_init__(self):
        if self.response is None:  # no dropped tokens: every generated token counts
            object.__setattr__(self, "response", self.mask)
        if self.truncated is None:
            object.__setattr__(self, "truncated", torch.zeros(len(self.mask), dtype=torch.bool))
        if self.rejected is None:
            object.__setattr__(self, "rejected", torch.zeros_like(self.mask))

    @property
    def num_groups(self) -> int:
        return len(self.mask) // self.group_size


def synthetic_minibatch(num_sequences: int, group_size: int = 8, max_new_tokens: int = 64, seed: int = 0) -> SyntheticBatch:
    """Groups of G completions with lengths log-uniform in [1, T], so every group is ragged."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(num_sequences, generator=gen, dtype=torch.float64)
    lengths = torch.exp(u * math.log(max_new_tokens)).round().long().clamp(1, max_new_tokens)  # (S,)
    logp = -(0.05 + 3.0 * torch.rand(num_sequences, max_new_tokens, generator=gen, dtype=torch.float64))
    adv = group_advantages(torch.rand(num_sequences, generator=gen, dtype=torch.float64), group_size)
    adv = torch.where(adv >= 0, adv.clamp(min=0.1), adv.clamp(max=-0.1))  # nonzero: w = -g / A
    return SyntheticBatch(logp=logp, mask=torch.arange(max_new_tokens) < lengths.unsqueeze(-1), advantages=adv,
                     group_ids=torch.arange(num_sequences) // group_size, group_size=group_size)


def minibatch_size(layouts: Sequence[int], group_size: int) -> int:
    """The smallest S that splits into whole groups and every W*A, with >= 2 sequences a microbatch."""
    step = math.lcm(group_size, *layouts)
    return step * math.ceil(max(2 * max(layouts), 2 * group_size) / step)


def _one_line(err: BaseException) -> str:
    if isinstance(err, SystemExit):  # sys.exit(code) in the user's code: name the code it passed
        return f"SystemExit({err.code!r})"
    return " ".join(f"{type(err).__name__}: {err}".split())


USER_EXITS = (Exception, SystemExit, KeyboardInterrupt)
"""What the user's module or loss may raise that is its failure, not the audit's verdict: sys.exit(0)
must not make the audit exit 0, a KeyboardInterrupt it raises must not print a traceback."""


_loaded_files = itertools.count()  # makes every loaded file's module name unique


def _import_file(path: Path):
    """Execute ``path`` as a module registered in sys.modules, with its folder on sys.path.

    Registered before it runs, under a name no other module has, because ``@dataclass`` (and
    ``typing.get_type_hints``) looks the class's module up in sys.modules while the file executes:
    under ``from __future__ import annotations`` an unregistered module fails there. The folder
    goes first on sys.path, as ``python path/to/file.py`` puts it, so ``import neighbour`` finds the
    file beside it from any working directory. Both stay after loading: the loss may import lazily,
    on its first call. ``imported_loss`` removes them when the audit is done.
    """
    name = f"_gradnorm_audit_{next(_loaded_files)}_{''.join(c if c.isalnum() else '_' for c in path.stem)}"
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_loss(spec: str) -> Callable:
    """``package.module:function`` or ``path/to/file.py:function`` -> the function.

    A file's module stays registered and its folder on sys.path (see ``_import_file``); use
    ``imported_loss`` to have both removed afterwards.
    """
    where, sep, name = spec.rpartition(":")
    if not (sep and where and name):
        raise ContractError(f"expected package.module:function or file.py:function, got {spec!r}")
    try:
        if where.endswith(".py") or "/" in where:
            if not Path(where).is_file():
                raise ContractError(f"no such file: {where}")
            module = _import_file(Path(where).resolve())
        else:
            module = importlib.import_module(where)
    except ContractError:
        raise
    except USER_EXITS as err:  # whatever the user's module raises (or exits with) on import
        raise ContractError(f"cannot import {where}: {_one_line(err)}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ContractError(f"{where} has no function {name!r}")
    return fn


@contextlib.contextmanager
def imported_loss(spec: str) -> Iterator[Callable]:
    """``load_loss`` for the length of a with-block, then sys.path and sys.modules as they were.

    Only what loading added goes: the folders it put on sys.path, and the modules imported from
    those folders (the loss file itself, the neighbours it imported, lazily or not). Modules that
    the loss imported from elsewhere (torch's lazily loaded parts) stay, as they would anyway.
    """
    path_before, modules_before = list(sys.path), set(sys.modules)
    try:
        yield load_loss(spec)
    finally:
        added = [folder for folder in sys.path if folder not in path_before]
        for name in set(sys.modules) - modules_before:
            origin = getattr(sys.modules.get(name), "__file__", None) or ""
            if any(Path(origin).is_relative_to(folder) for folder in added):
                sys.modules.pop(name, None)
        sys.path[:] = [folder for folder in sys.path if folder not in added]


@dataclass(frozen=True)
class Convention:
    """The outer loop around the user's microbatch loss."""

    scale_by_accum: bool = False
    """Whether the trainer divides each microbatch's returned loss by A before backward."""
    reduction: str = "mean"
    """How gradients combine over ranks: "mean" (DDP, FSDP) or "sum"."""
    cp_reduction: str = "mean"
    """How gradients combine over the K ranks of a context-parallel group: "mean" or "sum"."""
    pipeline_combine: str = "sum"
    """How a pipeline schedule combines its P microbatches' losses: "sum" or "mean" (x 1/P)."""

    @property
    def loop(self) -> Loop:
        return Loop(self.scale_by_accum, self.reduction, self.cp_reduction, self.pipeline_combine)


PAD_LOGP = -1.0
"""The log-prob a packed row's padding holds (it belongs to no sequence and carries no advantage)."""


def _call(loss_fn, batch: SyntheticBatch, layout: Layout, advantages: Tensor) -> Tensor:
    """g (S*T + 1,): the reduced gradient of one optimizer step w.r.t. every token's logp (last: padding)."""
    S, T = batch.mask.shape
    counts = simulated_counts(layout.plan, batch.mask.sum(-1), batch.group_ids, batch.num_groups)
    kept_lengths = batch.mask.sum(-1)  # (S,) |o_i| counted
    values = torch.cat([batch.logp.reshape(-1), torch.tensor([PAD_LOGP], dtype=batch.logp.dtype)])
    response = torch.cat([batch.response.reshape(-1), torch.tensor([False])])
    rejected = torch.cat([batch.rejected.reshape(-1), torch.tensor([False])])
    packed = "pack" in layout.axes
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError) as err:
        raise ContractError(f"cannot read the loss's signature: {_one_line(err)}") from None
    grad = torch.zeros(S * T + 1, dtype=batch.logp.dtype)
    for call in layout.calls:  # every forward of the step: gradients add up
        seq = call.sequences  # (k,) minibatch indices
        leaf = values[call.index].clone().requires_grad_(True)  # (n, L) ALGO LOGIC: the leaf we read
        if packed:  # a packed row's advantages are per token: its sequence's, 0 on padding
            adv = torch.where(call.sequence >= 0, advantages[seq][call.sequence.clamp(min=0)], 0.0)  # (n, L)
        else:
            adv = advantages[seq]  # (n,)
        offered = {
            "ref_logp": leaf.detach().clone(), "num_tokens": counts.tokens, "num_sequences": counts.sequences,
            "num_groups": counts.active_groups, "group_tokens": counts.group_tokens[batch.group_ids[seq]],
            "group_ids": batch.group_ids[seq], "world_size": layout.world_size, "accum_steps": call.accum_steps,
            "sequence_ids": call.sequence, "sequence_tokens": kept_lengths[seq],
            "num_response_tokens": int(batch.response.sum()), "truncated": batch.truncated[seq],
            "rejected": rejected[call.index], "context_parallel": layout.context_parallel,
            "pipeline_microbatches": layout.pipeline_microbatches,
        }
        asked = {k: v for k, v in offered.items() if k in signature.parameters}
        where = f"(W={layout.world_size} {layout.label}, {call.where[1:]}"
        mask = response[call.index]
        try:
            signature.bind(leaf, leaf.detach().clone(), adv, mask, **asked)
        except TypeError as err:
            raise ContractError(f"the loss cannot take the audit's arguments ({err}); it gets logp, old_logp, "
                                f"advantages, mask and, by name, any of: {', '.join(COUNTS)}") from None
        try:
            loss = loss_fn(leaf, leaf.detach().clone(), adv, mask, **asked)
        except USER_EXITS as err:
            raise ContractError(f"the loss raised {_one_line(err)} {where}") from None
        if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            got = f"shape {tuple(loss.shape)} {loss.dtype}" if isinstance(loss, Tensor) else type(loss).__name__
            raise ContractError(f"the loss must return a scalar float tensor, got {got} {where}")
        if not torch.isfinite(loss).all():
            raise ContractError(f"the loss returned {loss.item()} {where}")
        if not loss.requires_grad:
            raise ContractError(f"the loss is not differentiable in logp (no gradient) {where}")
        try:
            (g,) = torch.autograd.grad(loss.reshape(()) * call.scale, leaf, allow_unused=True)  # loop, reductions
        except RuntimeError as err:
            raise ContractError(f"backward through the loss failed: {_one_line(err)} {where}") from None
        if g is None:
            raise ContractError(f"the loss is not differentiable in logp (no gradient) {where}")
        if not torch.isfinite(g).all():
            raise ContractError(f"the loss has a NaN or inf gradient {where}")
        grad.index_add_(0, call.index.reshape(-1), g.reshape(-1))
    return grad


@dataclass
class Result:
    """The weights of one configuration, and each rank's share of the update."""

    label: str
    plan: Plan
    weights: Tensor  # (S, T) float64: w[i, t], the token's weight in J (0 where the loss ignores it)
    residual: Tensor  # (S, T): the gradient part that does not scale with the advantages
    change: float = 0.0  # the largest relative change of a token's weight against the reference
    update_share: Tensor = field(default=None)  # (W*K,) each rank's share of sum w
    token_share: Tensor = field(default=None)  # (W*K,) each rank's share of the response tokens
    distance: dict[str, float] = field(default_factory=dict)  # mode -> max |w - w_mode| / max |w_mode|
    factor: dict[str, float] = field(default_factory=dict)  # mode -> c, when w = c * w_mode to tol (else absent)
    layout: Layout | None = None  # every call of the step (the axes beyond the plan)

    @property
    def world_size(self) -> int:
        return len(self.plan)

    @property
    def accum_steps(self) -> int:
        return len(self.plan[0])

    @property
    def axes(self) -> frozenset[str]:
        """The splits beyond a fixed-count plan this configuration has: "budget", "pack", "cp", "pipeline"."""
        return self.layout.axes if self.layout else frozenset()

    @property
    def accum_label(self) -> str:
        """A, or its range over the ranks when a token budget gives them different counts ("3-5")."""
        counts = [len(rank) for rank in self.plan]
        return str(counts[0]) if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"

    @property
    def equal_counts(self) -> bool:
        """Every microbatch holds the same number of sequences (fixed-size microbatches)."""
        return len({len(mb) for rank in self.plan for mb in rank}) == 1


def measure(loss_fn, batch: SyntheticBatch, plan: Plan | Layout, convention: Convention = Convention(),
            label: str = "") -> Result:
    """The effective weight w[i, t] of every token of ``batch`` under ``plan`` (see the module docstring).

    ``plan``: a fixed-count plan of ``gradnorm.core.sharding``, or a ``splits.Layout`` (any axis).
    """
    S, T = batch.mask.shape
    if isinstance(plan, Layout):
        layout = plan
        label = label or layout.label
    else:
        validate_plan(plan, S)
        layout = build(label, plan, batch.response.sum(-1), T, convention.loop)
    plus = _call(loss_fn, batch, layout, batch.advantages)
    minus = _call(loss_fn, batch, layout, -batch.advantages)
    adv = batch.advantages.unsqueeze(-1)  # (S, 1)
    weights = -(plus - minus)[: S * T].reshape(S, T) / (2 * adv)  # a packed row's padding dropped
    owner = torch.zeros(S * T + 1, dtype=torch.long)  # the rank that holds each position
    for call in layout.calls:
        owner[call.index.reshape(-1)] = call.rank
    owner = owner[: S * T]
    total = weights.sum()
    flat, counted = weights.reshape(-1), batch.mask.reshape(-1)
    ranks = range(layout.num_ranks)
    update = torch.stack([flat[owner == r].sum() for r in ranks]) / (total if total != 0 else 1.0)
    tokens = torch.stack([counted[owner == r].sum() for r in ranks]).double() / batch.mask.sum()
    return Result(label, layout.plan, weights, (plus + minus)[: S * T].reshape(S, T) / 2, update_share=update,
                  token_share=tokens, layout=layout)


@dataclass(frozen=True)
class Near:
    """The mode a loss equals up to one uniform factor per configuration: w = k * W^p * A^q * w_mode.

    Under each configuration every token's weight is the same multiple c of the mode's weight; c
    changes with (W, A) as W^p * A^q, k being c under the reference. ``powers`` holds every (p, q)
    with |p|, |q| <= 2 and the fewest |p| + |q| that fits each c to tol (two when W = A hides which),
    and is empty when none does.
    """

    mode: str
    scale: float  # k
    powers: tuple[tuple[int, int], ...]  # (p, q)
    factors: tuple[float, ...]  # c of each configuration, in the order of Report.results


@dataclass
class Report:
    """The audit of one loss: its weights under every configuration, and the verdict."""

    name: str
    batch: SyntheticBatch
    convention: Convention
    results: list[Result]  # results[0] is the reference: one process, one microbatch
    distance: dict[str, float]  # mode -> max |w - w_mode| / max |w_mode| over every configuration
    constant: float  # C fitted to the reference: N / sum w (inf when sum w <= 0)
    change: float  # the largest relative change of any token's weight across configurations
    leak: float  # the largest share of |w| on tokens outside the mask
    residual: float  # max |gradient not scaling with A| / max |A * w|, the surrogate's gradient
    tol: float
    negative: float = 0.0  # the largest share of the weight inside the mask that is negative
    near: Near | None = None  # when no mode matches: the one it equals up to a factor, if any
    masked: MaskedFinding | None = None  # with dropped tokens in the batch: what the denominator does with them

    @property
    def matches(self) -> list[str]:
        return [m for m in MODES if self.distance[m] <= self.tol]

    @property
    def equals(self) -> str | None:
        """The first gradnorm mode whose weights these are, under every configuration, or None."""
        return self.matches[0] if self.matches else None

    @property
    def invariant(self) -> bool:
        """Every token's weight is the same under every configuration, to ``tol``."""
        return self.change <= self.tol

    @property
    def leaks(self) -> bool:
        """Some weight falls on tokens outside the mask (padding, prompt)."""
        return self.leak > self.tol

    @property
    def wrong_sign(self) -> bool:
        """Some response token has a negative weight: the loss rises where the advantage is positive."""
        return self.negative > self.tol

    def _changes(self, equal: bool) -> list[float]:
        # results[0], the reference, is one microbatch: equal counts trivially, and no change by definition.
        return [r.change for r in self.results[1:] if r.equal_counts == equal]

    @property
    def skewed_only_by_unequal_counts(self) -> bool:
        """Invariant on every plan with equal-count microbatches (at least one), skewed on another."""
        even, uneven = self._changes(True), self._changes(False)
        return bool(even) and max(even) <= self.tol and bool(uneven) and max(uneven) > self.tol

    @property
    def equals_at_equal_counts(self) -> str | None:
        """The first mode matched on the reference and every plan with equal-count microbatches."""
        even = [r for r in self.results if r.equal_counts]
        return next((m for m in MODES if max(r.distance[m] for r in even) <= self.tol), None)

    @property
    def exit_code(self) -> int:
        """The command's status: 0 invariant, masked and signed right; 1 skewed, leaking or wrong-signed."""
        miscounts = self.masked is not None and self.masked.counts_dropped is True
        return 0 if self.invariant and not self.leaks and not self.wrong_sign and not miscounts else 1


def _mode_weights(mode: str, mask: Tensor, batch: SyntheticBatch, plan: Plan, constant: float) -> Tensor:
    """(S, T) the weights gradnorm's ``mode`` gives under ``plan``, counting ``mask``; ``constant`` uses C.

    Only ``local`` depends on the plan: 1 / (W * A_r * N[r, m]), written out here because a token
    budget gives ranks different numbers A_r of microbatches (core's plans have one A). The other
    modes' weights are the same under any plan, so they come from core's one-process plan.
    """
    if mode != "local":
        den = constant if mode == "constant" else mode
        return effective_weights(mask, batch.group_ids, batch.num_groups, den, [[torch.arange(len(mask))]])
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for rank in plan:
        for mb in rank:
            local_tokens = int(mask[mb].sum())
            if local_tokens:
                out[mb] = mask[mb].double() / (len(plan) * len(rank) * local_tokens)
    return out


def _fit(weights: Tensor, expected: Tensor, tol: float) -> float | None:
    """c when w = c * w_mode to tol (least squares: c = <w, e> / <e, e>), else None."""
    norm = float((expected * expected).sum())
    c = float((weights * expected).sum()) / norm if norm > 0 else 0.0
    if c == 0 or (weights - c * expected).abs().max() > tol * abs(c) * expected.abs().max():
        return None
    return c


def _powers(factors: Sequence[float], results: Sequence[Result], tol: float) -> tuple[tuple[int, int], ...]:
    """Every (p, q) of the fewest |p| + |q| with c = k * W^p * A^q for one k over all configurations."""
    fits = []
    for p in range(-2, 3):
        for q in range(-2, 3):
            ks = [c / (r.world_size ** p * r.accum_steps ** q) for c, r in zip(factors, results)]
            if all(abs(k - ks[0]) <= tol * abs(ks[0]) for k in ks):
                fits.append((abs(p) + abs(q), (p, q)))
    fewest = min((n for n, _ in fits), default=None)
    return tuple(pq for n, pq in fits if n == fewest)


def _nearest(results: Sequence[Result], tol: float) -> Near | None:
    """The mode the weights equal up to a factor, preferring k = +-1 and a law in W and A."""
    near = []
    for mode in MODES:
        factors = [r.factor.get(mode) for r in results]
        if None not in factors:
            powers = _powers(factors, results, tol)
            p, q = powers[0] if powers else (0, 0)
            k = factors[0] / (results[0].world_size ** p * results[0].accum_steps ** q)  # c at W = A = 1
            near.append(Near(mode, k, powers, tuple(factors)))
    preference = [(not n.powers, abs(abs(n.scale) - 1) > tol, MODES.index(n.mode)) for n in near]
    return near[preference.index(min(preference))] if near else None


def _negative_share(weights: Tensor, mask: Tensor) -> float:
    """sum of |w| over response tokens with w < 0, over sum of |w| on response tokens (0 when all are 0).

    A negative weight means minimizing the loss lowers the token's log-prob where its advantage is
    positive (w = -g / A_i): the sign of a returned objective, or of logp and old_logp swapped.
    """
    inside = weights[mask]
    total = float(inside.abs().sum())
    return float(inside.clamp(max=0).abs().sum()) / total if total > 0 else 0.0


def audit_plans(loss_fn, batch: SyntheticBatch, plans: dict[str, Plan] | Sequence[tuple[str, Plan]],
                convention: Convention = Convention(), name: str = "loss", tol: float = 1e-6) -> Report:
    """Audit ``loss_fn`` under every (label, plan); the first is the reference the others are compared with."""
    pairs = list(plans.items() if isinstance(plans, dict) else plans)
    if len(pairs) < 2:  # a reference alone: every verdict would be vacuously INVARIANT
        raise ContractError("nothing to compare: only one process with one microbatch was asked for; "
                            "give a world size or accumulation steps above 1")
    results = [measure(loss_fn, batch, plan, convention, label) for label, plan in pairs]
    cache: dict[str, Tensor] = {}  # every mode but `local` gives the same weights under any plan
    ref = results[0].weights
    scale = ref.abs().max()
    if scale == 0:
        raise ContractError("the loss has zero gradient in logp: no token has any weight")
    floor = torch.where(ref.abs() > 1e-12 * scale, ref.abs(), scale)  # relative per token, w = 0 against the largest
    for res in results:
        res.change = float(((res.weights - ref).abs() / floor).max())
    inside = float(ref[batch.mask].sum())
    constant = float(batch.mask.sum()) / inside if inside > 0 else math.inf  # C = N / sum w: 1/C per token
    for res in results:
        for mode in MODES:
            if mode == "constant" and not math.isfinite(constant):
                res.distance[mode] = math.inf
                continue
            if mode == "local":
                expected = _mode_weights(mode, batch.mask, batch, res.plan, constant)  # (S, T)
            else:
                expected = cache.get(mode)
                if expected is None:
                    expected = cache[mode] = _mode_weights(mode, batch.mask, batch, res.plan, constant)
            res.distance[mode] = float((res.weights - expected).abs().max() / expected.abs().max())
            if (c := _fit(res.weights, expected, tol)) is not None:
                res.factor[mode] = c
    distance = {mode: max(r.distance[mode] for r in results) for mode in MODES}
    leak = max(float(r.weights[~batch.mask].abs().sum() / r.weights.abs().sum()) for r in results)
    negative = max(_negative_share(r.weights, batch.mask) for r in results)
    adv = batch.advantages.unsqueeze(-1)  # (S, 1)
    residual = max(float(r.residual.abs().max()) for r in results) / max(
        float((r.weights * adv).abs().max()) for r in results)
    report = Report(name, batch, convention, results, distance, constant, max(r.change for r in results), leak,
                    residual, tol, negative)
    if report.equals is None:
        report.near = _nearest(results, tol)
    if batch.count_masked is not None:  # right: counts over the kept tokens; counting: over every generated one
        modes = [m for m in MODES if m not in ("local", "constant")]
        right = {m: cache[m] for m in modes}
        counting = {m: _mode_weights(m, batch.response, batch, results[0].plan, constant) * batch.mask for m in modes}
        report.masked = masked_finding(batch, results[0].weights, right, counting, tol)
    return report


def audit(loss_fn, world_sizes: Sequence[int] = (8,), accum_steps: Sequence[int] = (4,),
          shardings: Sequence[str] = SHARD_KINDS, convention: Convention = Convention(), group_size: int = 8,
          max_new_tokens: int = 64, seed: int = 0, name: str | None = None, tol: float = 1e-6,
          splits: Splits = Splits(), count_masked: str | None = None) -> Report:
    """Audit ``loss_fn`` for every (W, A, sharding) and split asked for, against one process with one microbatch.

    ``splits``: the axes beyond (W, A, sharding) (``gradnorm.audit.splits``); ``count_masked``: add
    truncated responses and rejected tokens, and declare which the loss should count
    (``gradnorm.audit.masking``). W = A = 1 with no axis is the reference itself; asking for
    nothing else is a ``ContractError``.
    """
    sizes = [w * a * splits.granularity for w in world_sizes for a in accum_steps]
    batch = synthetic_minibatch(minibatch_size(sizes, group_size), group_size, max_new_tokens, seed)
    if count_masked is not None:
        batch = with_masked_tokens(batch, count_masked, seed)
    try:
        pairs = [(layout.label, layout) for layout in
                 layouts(batch.response.sum(-1), max_new_tokens, world_sizes, accum_steps, shardings, splits,
                         convention.loop)]
    except ValueError as err:  # a split the minibatch cannot take (a budget below the longest response)
        raise ContractError(str(err)) from None
    return audit_plans(loss_fn, batch, pairs, convention, name or getattr(loss_fn, "__name__", "loss"), tol)

