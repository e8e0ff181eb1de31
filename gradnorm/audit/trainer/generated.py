"""Reading a trainer that samples its own completions (GRPO): cells, advantages, and the modes on each run's batch.

A GRPO trainer's completions are sampled, so each run (one process, or W ranks x A steps) trains
on a batch of its own: its weights cannot be compared token by token with another run's. Each run
is compared instead with gradnorm's modes computed on its own batch (``gradnorm.audit.objectives.
mode_weights``: token 1/N, sequence 1/(S*|o_i|), group 1/(Ga*N_g), local 1/(W*A*N[r,m])); a trainer
is invariant when every run equals the same invariant mode.

What a run trained on comes from the recorded inputs of its forwards with gradients: in every row,
the prompt (two ids of its own: ``gradnorm.audit.trainer.data.grpo_prompts``), then the completion
up to and including its first EOS. The probe samples content ids uniformly (and EOS with a fixed
probability), so two positions of the batch may share an (input id, label) pair, a **cell**: the
gradient holds the sum of their w * A, and so does the comparison, which is made cell by cell:

    measured(k, y) = sum over positions (k -> y) of w * A        expected_mode(k, y) = the same sum of w_mode * A

On policy (the ratio is 1) the clipped surrogate -A * ratio has slope -A in log p. The probe's
reward (``parity_reward``) with two completions a prompt gives every group rewards {0, 1}
(advantages +-c, one c for the whole batch whatever the std scaling: ``ADVANTAGE``, TRL's default
``scale_rewards="group"``) or equal rewards (advantages 0, no gradient: those cells read 0 and are
left out of the comparison; their tokens still count in every mode's N). A completion whose partner
trains in another optimizer step (a generation batch that spans several) takes its advantage's
sign from its own first cell. A run whose weights equal
a mode up to one uniform factor is said so, with the factor (another std scaling of the
advantages shows as one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradnorm.audit.objectives import GRPO, mode_weights
from gradnorm.audit.trainer.data import ProbeData, parity_reward
from gradnorm.audit.trainer.model import EOS, FIRST_CONTENT, PAD, next_token_probs, sink, token_text
from gradnorm.audit.trainer.readout import ReadoutError, step_gradient

ADVANTAGE = 0.5 / (math.sqrt(0.5) + 1e-4)
"""c: the advantage of a group with rewards {0, 1}, centered and divided by its std (unbiased, sqrt(1/2)) + 1e-4."""
MODES = ("token", "sequence", "group", "local")


@dataclass
class Completion:
    prompt: int  # the prompt's index: the group
    tokens: list[int]  # the labels: content ids, then EOS unless cut at the trainer's maximum
    context: int  # the prompt's last id: the input the first label is predicted from
    rank: int
    microbatch: int

    @property
    def cells(self) -> list[tuple[int, int]]:
        inputs = [self.context, *self.tokens[:-1]]
        return list(zip(inputs, self.tokens))


@dataclass
class GeneratedRun:
    """One run's batch, its cells and what the gradient says of each."""

    completions: list[Completion]
    mask: Tensor  # (S, T) bool: each completion's labels
    advantages: Tensor  # (S,) float64: +-ADVANTAGE, or 0 for a group of equal rewards
    plan: list[list[Tensor]]  # plan[r][m]: the completions rank r's m-th forward trained on
    cells: dict[tuple[int, int], list[tuple[int, int]]]  # (k, y) -> [(completion, position)]
    measured: dict[tuple[int, int], float]
    stray: float
    ranks_agree: bool
    world_size: int
    modes: dict[str, "ModeFit"] = field(default_factory=dict)
    drops: bool | None = None  # whether its gradient showed labels beyond rows at a forward's edge (None: no row said)
    unsure: int = 0  # rows at a forward's edge read as ending there for want of a gradient that says
    reread: object = field(default=None, repr=False)  # drops -> the run read again with that convention

    @property
    def accum_steps(self) -> int:
        return max(len(rank) for rank in self.plan)

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


@dataclass(frozen=True)
class ModeFit:
    distance: float  # max |measured - f * expected| / max |f * expected| over the readable cells
    factor: float  # f: the uniform factor that fits best (1 when the mode is met exactly)


@dataclass
class _Row:
    """A completion as one recorded row holds it: its labels up to the row's end."""

    prompt: int
    context: int
    tokens: list[int]  # the labels the input holds: up to and including EOS, or up to the row's last column
    rank: int
    microbatch: int
    forward: tuple[int, int]  # (record, forward): the forward call it was read from
    edge: bool  # the row ends at the forward's last column without EOS or PAD: one more label may lie beyond


def _rows(data: ProbeData, records: list[dict]) -> list[_Row]:
    """Every completion in the recorded inputs: a row is [PAD...] prompt completion [PAD...]."""
    prompt_of = {row[0].label: p for p, row in enumerate(data.rows)}  # a prompt's second id -> prompt
    first_id = {p: row[0].input_id for p, row in enumerate(data.rows)}
    found = []
    for r, record in enumerate(records):
        microbatches = record.get("microbatches") or range(len(record["forwards"]))  # the recorder's, else one each
        for f, (forward, m) in enumerate(zip(record["forwards"], microbatches)):
            for row in forward.reshape(-1, forward.shape[-1]).tolist():
                at = next((j for j, i in enumerate(row) if i in prompt_of), None)
                if at is None or at == 0 or row[at - 1] != first_id[prompt_of[row[at]]]:
                    if any(i != PAD for i in row):
                        raise ReadoutError(
                            f"a forward that took part in the backward holds a row without its prompt ({row[:4]}...): "
                            "the trainer computes a prompt apart from its completion (a prompt forwarded once and "
                            "shared through its KV cache), so the readout cannot tell whose completion it is; audit "
                            "the trainer with a forward of whole rows (gradnorm/train.py: --gradient-checkpointing)")
                    continue
                tokens, edge = [], True
                for i in row[at + 1:]:
                    if i == PAD:
                        edge = False
                        break
                    tokens.append(i)
                    if i == EOS:
                        edge = False
                        break
                if tokens or edge:
                    found.append(_Row(prompt_of[row[at]], row[at], tokens, record["rank"], m, (r, f), edge))
    return found


def _cells(context: int, tokens: list[int]) -> list[tuple[int, int]]:
    return list(zip([context, *tokens[:-1]], tokens))


def _complete(rows: list[_Row], measured: Tensor, vocab_size: int,
              drops: bool | None = None) -> tuple[list[Completion], list[int], bool | None]:
    """Each row's whole completion, the last labels the inputs lack read from the gradient; the completions
    whose last label no gradient showed (taken as EOS); and what the gradient said of the trainer (None: nothing).

    A trainer that forwards ``tokens[:, :-1]`` (gradnorm's) never feeds the last label of a forward's longest
    row: that row ends at the forward's edge, neither EOS nor PAD after its last id k. A trainer that feeds whole
    rows leaves a row at the edge only when its maximum length cut it (no label beyond). Which one the trainer
    is, the gradient says: in column k, a label no known cell explains with measured(k, y) != 0 is the missing
    last label. Rows whose known cells read 0 (a group of equal rewards: no gradient) say nothing, nor do rows
    whose label may share its cell with another position's (a column k other positions use); when no row
    of the run says, ``drops`` (what another run of the same trainer said: ``GeneratedReport``) decides, and
    without it the rows end where the inputs end. A dropped label no gradient shows is EOS: the row ended
    before the trainer's maximum (which ``read_generated`` checks against the rewards).
    """
    known = [_cells(r.context, r.tokens) for r in rows]
    count: dict[tuple[int, int], int] = {}
    for cells in known:
        for cell in cells:
            count[cell] = count.get(cell, 0) + 1
    values = [abs(float(measured[y, k])) for k, y in count]
    top = max(values, default=0.0)
    threshold = 1e-4 * top if top > 0 else math.inf  # fp32 rounding reads ~1e-7 of the largest cell
    explained: dict[int, set[int]] = {}
    for k, y in count:
        explained.setdefault(k, set()).add(y)
    V = vocab_size
    extra, says, visible = {}, {}, set()
    for i, row in enumerate(rows):
        if not row.edge:
            continue
        k = row.tokens[-1] if row.tokens else row.context
        column = measured[:, k].abs()
        column[sink(V)] = 0.0
        extra[i] = [y for y in (column > threshold).nonzero().flatten().tolist() if y not in explained.get(k, ())]
        if len(extra[i]) > 1:
            raise ReadoutError(f"the row ending in id {k} at a forward's edge has {len(extra[i])} labels in the "
                               "gradient that no recorded input explains: its last label cannot be read")
        own = [cell for cell in known[i] if count[cell] == 1]
        if any(abs(float(measured[y, k2])) > threshold for k2, y in own):  # its weight shows
            visible.add(i)
            if extra[i] or not explained.get(k):  # else its label may share a cell another position explains
                says[i] = bool(extra[i])
    if len(set(says.values())) > 1:
        raise ReadoutError("rows at a forward's edge disagree on whether the trainer trained a label beyond them "
                           "(some show one in the gradient, some do not): the readout cannot tell where they end")
    said = next(iter(says.values())) if says else None
    drops = said if said is not None else bool(drops)
    completions, unseen = [], []
    for i, row in enumerate(rows):
        tokens = list(row.tokens)
        if row.edge and drops:
            k = tokens[-1] if tokens else row.context
            if extra[i]:
                tokens.append(extra[i][0])
            elif i in visible:  # its label shares a cell with another position of column k
                shared = explained[k]
                if EOS not in shared and len(shared) > 1:
                    raise ReadoutError(f"the row ending in id {k} at a forward's edge shares its last label with one "
                                       f"of {len(shared)} other positions' labels: the readout cannot tell which")
                tokens.append(EOS if EOS in shared else next(iter(shared)))
            else:  # no gradient on the row: nothing to read, EOS unless the trainer's maximum cut it
                tokens.append(EOS)
                unseen.append(len(completions))
        if tokens:
            completions.append(Completion(row.prompt, tokens, row.context, row.rank, row.microbatch))
    return completions, unseen, said


def read_generated(data: ProbeData, records: list[dict], drops: bool | None = None) -> GeneratedRun:
    """The batch a GRPO run trained on at its first optimizer step, and every cell's measured w * A.

    ``drops``: whether the trainer trains a label beyond a row at a forward's edge, for a run whose gradient
    cannot say (``_complete``); None reads such rows as ending there."""
    grad, ranks_agree = step_gradient(records)
    rows = _rows(data, records)
    if not rows:
        raise ReadoutError("no forward with gradients held a probe prompt: does the trainer train on the probe's "
                           "prompts (the data set's 'prompt' column)?")
    p = next_token_probs(data.vocab_size, generating=True)
    p_content = float(p[FIRST_CONTENT])
    # column k's sum over its positions of w * A: every content row no position of k uses as a label reads
    # p_content times it, and those are all but a handful of the column's rows: the median is one of them
    column_sum = grad[FIRST_CONTENT: sink(data.vocab_size)].median(dim=0).values / p_content  # (V,)
    everywhere = column_sum.unsqueeze(0) * p.unsqueeze(-1) - grad  # (V, V): [y, k] -> measured(k, y)
    completions, unseen, said = _complete(rows, everywhere, data.vocab_size, drops)
    S, T = len(completions), max(len(c.tokens) for c in completions)
    mask = torch.zeros(S, T, dtype=torch.bool)
    for i, c in enumerate(completions):
        mask[i, : len(c.tokens)] = True
    words = [" ".join(token_text(t) for t in c.tokens if t != EOS) for c in completions]
    rewards = torch.tensor(parity_reward(None, words), dtype=torch.float64)
    groups = torch.tensor([c.prompt for c in completions])
    advantages = torch.zeros(S, dtype=torch.float64)
    for g in groups.unique():
        members = groups == g
        centered = rewards[members] - rewards[members].mean()
        advantages[members] = torch.sign(centered) * ADVANTAGE
    lone = [i for i in range(S) if int((groups == groups[i]).sum()) == 1]
    for i in lone:  # its partner trains in another optimizer step: the sign of its first cell says A's
        k, y = completions[i].cells[0]
        value = float(grad[y, k])  # -w * A (plus p_y * sum, which is 0 for a column of this completion alone)
        advantages[i] = -math.copysign(ADVANTAGE, value) if value != 0 else 0.0
    cut = [i for i in unseen if advantages[i] != 0]
    if cut:  # its group's rewards differ, yet no label of its showed in the gradient: it never ended in EOS
        c = completions[cut[0]]
        raise ReadoutError(f"a completion of prompt {c.prompt} ends at a forward's edge after {len(c.tokens) - 1} "
                           "labels with no gradient to read its last one from, and its group's rewards differ: the "
                           "trainer's maximum length cut it, which the readout cannot read; raise the build's maximum "
                           "completion length")
    ranks = sorted({c.rank for c in completions})
    plan = [[torch.tensor([i for i, c in enumerate(completions) if c.rank == r and c.microbatch == m])
             for m in sorted({c.microbatch for c in completions if c.rank == r})] for r in ranks]
    cells: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, c in enumerate(completions):
        for t, cell in enumerate(c.cells):
            cells.setdefault(cell, []).append((i, t))
    measured = {(k, y): float(everywhere[y, k]) for (k, y) in cells}
    expected_off = torch.zeros_like(grad)  # what the gradient holds if only the cells carry weight
    for k in {k for k, _ in cells}:
        expected_off[:, k] = p * column_sum[k]
    for (k, y), value in measured.items():
        expected_off[y, k] -= value
    total = sum(abs(v) for v in measured.values())
    stray = float((grad - expected_off).abs().sum()) / total if total > 0 else 0.0
    world = records[0]["world_size"]
    edges = sum(r.edge for r in rows)
    return GeneratedRun(completions, mask, advantages, plan, cells, measured, stray, ranks_agree, world,
                        drops=said, unsure=edges if said is None and drops is None else 0,
                        reread=lambda drops: read_generated(data, records, drops))


def fit_modes(run: GeneratedRun) -> dict[str, ModeFit]:
    """Each mode's distance from the run, cell by cell, after the uniform factor that fits best."""
    groups = torch.tensor([c.prompt for c in run.completions])
    _, group_ids = groups.unique(return_inverse=True)
    num_groups = int(group_ids.max()) + 1
    readable = [cell for cell, where in run.cells.items() if any(run.advantages[i] != 0 for i, _ in where)]
    measured = torch.tensor([run.measured[c] for c in readable], dtype=torch.float64)
    for mode in MODES:
        w = mode_weights(GRPO, mode, run.mask, group_ids, num_groups, run.plan, 0.0)  # (S, T)
        wa = w * run.advantages.unsqueeze(-1)
        expected = torch.tensor([sum(float(wa[i, t]) for i, t in run.cells[c]) for c in readable], dtype=torch.float64)
        norm = float(expected @ expected)
        factor = float(measured @ expected) / norm if norm > 0 else math.nan
        scaled = factor * expected
        top = float(scaled.abs().max()) if len(scaled) else 0.0
        distance = float((measured - scaled).abs().max()) / top if top > 0 else math.inf
        run.modes[mode] = ModeFit(distance, factor)
    return run.modes


INVARIANT_MODES = ("token", "sequence", "group")


@dataclass(frozen=True)
class Decision:
    """What the runs say together, before any words.

    ``shape``: the invariant mode every run matches up to one uniform factor per run (None if some
    run matches none); ``law``: how those factors go: "exact" (all 1), "advantages" (all the same
    f: the trainer scales its advantages otherwise than the probe assumes, the same on every split),
    "constant" (`token`'s shape with f / N the same in every run: a constant denominator C = N / f),
    "varies" (a step weighs a different multiple of the mode in each run: skewed).
    """

    shape: str | None
    law: str | None
    factors: tuple[float, ...]
    constant: float | None = None

    @property
    def invariant(self) -> bool:
        return self.shape is not None and self.law in ("exact", "advantages", "constant")


def _same(values, tol: float) -> bool:
    return max(values) - min(values) <= tol * max(abs(v) for v in values)


@dataclass
class GeneratedReport:
    """The trainer audit of a GRPO trainer: each run against the modes on its own batch, and the verdict."""

    name: str
    labels: list[str]
    runs: list[GeneratedRun]  # runs[0]: the reference (one process, one microbatch)
    tol: float

    def __post_init__(self):
        """A trainer feeds its rows the same way in every run: a run whose gradient could not say whether a label
        lies beyond its rows at a forward's edge (every such row in a group of equal rewards) is read again as
        the runs that could say."""
        said = {r.drops for r in self.runs if r.drops is not None}
        if len(said) == 1:
            drops = said.pop()
            for i, run in enumerate(self.runs):
                if run.unsure and run.reread is not None:
                    try:
                        self.runs[i] = run.reread(drops)
                    except ReadoutError:
                        continue  # kept as read; format() counts its unsure rows

    def fits(self, run: GeneratedRun) -> dict[str, ModeFit]:
        return run.modes or fit_modes(run)

    def equals(self, run: GeneratedRun) -> str | None:
        """The mode the run's weights equal exactly (factor 1), invariant modes first; None if none."""
        fits = self.fits(run)
        for mode in (*INVARIANT_MODES, "local"):
            if fits[mode].distance < self.tol and abs(fits[mode].factor - 1) < self.tol:
                return mode
        return None

    def shaped(self, run: GeneratedRun) -> str | None:
        """The invariant mode the run equals up to one uniform factor (a scale error), if it equals none exactly."""
        fits = self.fits(run)
        return next((m for m in INVARIANT_MODES if fits[m].distance < self.tol), None)

    @property
    def reference_mode(self) -> str | None:
        return self.equals(self.runs[0]) or self.shaped(self.runs[0])

    def decision(self) -> Decision:
        shapes = [self.shaped(r) for r in self.runs]
        shape = shapes[0] if shapes[0] is not None and all(m == shapes[0] for m in shapes) else None
        if shape is None:
            return Decision(None, None, ())
        factors = tuple(self.fits(r)[shape].factor for r in self.runs)
        if all(abs(f - 1) < self.tol for f in factors):
            return Decision(shape, "exact", factors)
        if _same(factors, self.tol):
            return Decision(shape, "advantages", factors)
        per_token = [f / r.tokens for f, r in zip(factors, self.runs)]
        if shape == "token" and _same(per_token, self.tol):
            return Decision(shape, "constant", factors, constant=1 / per_token[0])
        return Decision(shape, "varies", factors)

    @property
    def invariant(self) -> bool:
        return self.decision().invariant and all(r.ranks_agree for r in self.runs)

    @property
    def exit_code(self) -> int:
        return 0 if self.invariant else 1

    def verdict(self) -> str:
        d = self.decision()
        disagree = [f"under {label} the ranks stepped with different gradients (no all-reduce?)"
                    for label, r in zip(self.labels, self.runs) if not r.ranks_agree]
        if d.invariant and not disagree:
            said = (f"INVARIANT: every run equals gradnorm's `{d.shape}` on its own batch, to {self.tol:g} (the runs "
                    "sample different completions, so each is compared with the modes, not token by token)")
            if d.law == "advantages":
                said += (f"; every weight is {d.factors[0]:.6g} times it in every run: the trainer scales its "
                         f"advantages otherwise than TRL's default the probe assumes (c = {ADVANTAGE:.6g})")
            if d.law == "constant":
                said = (f"INVARIANT: every run equals a constant denominator C = {d.constant:.6g} (Dr GRPO's), "
                        "the same in every run while each run's N differs")
            return said
        if d.shape is not None and d.law == "varies":
            spread = ", ".join(f"{label} x{f:.6g}" for label, f in zip(self.labels, d.factors))
            return (f"SKEWED: every run has `{d.shape}`'s shape, but its step weighs a different multiple of it in "
                    f"each run ({spread}): a count over another window than the optimizer step's (a generation "
                    "batch of several steps?)" + "".join(f"; {x}" for x in disagree))
        said = []
        for label, run in zip(self.labels, self.runs):
            fits = self.fits(run)
            if self.equals(run) == "local":
                said.append(f"{label} equals `local`: each microbatch by its own count")
            elif self.shaped(run) is None and fits["local"].distance < self.tol:  # and the advantages scaled otherwise
                said.append(f"{label} equals `local` x{fits['local'].factor:.6g}: each microbatch by its own count")
            elif self.shaped(run) is None:
                best = min(fits, key=lambda m: fits[m].distance)
                said.append(f"{label} equals no gradnorm mode (nearest `{best}`, {fits[best].distance:.3g} away)")
            else:
                said.append(f"{label} equals `{self.shaped(run)}` x{fits[self.shaped(run)].factor:.6g}")
        return "SKEWED: " + "; ".join(said + disagree)

    def format(self) -> str:
        lines = [f"audit of {self.name} (GRPO, a generating trainer)",
                 "each run samples its own completions (2 a prompt, rewards {0, 1}); every run is compared with "
                 "gradnorm's modes on its own batch, cell by cell (distance after the best uniform factor; the factor)",
                 f"  W   A  {'run':<12} {'seqs':>5} {'tokens':>6}  " + "  ".join(f"{m:>19}" for m in MODES)
                 + "  equals"]
        for label, run in zip(self.labels, self.runs):
            fits = self.fits(run)
            cells = "  ".join(f"{fits[m].distance:9.2g} x{fits[m].factor:<8.4g}" for m in MODES)
            exact = self.equals(run) or (f"{self.shaped(run)} x{fits[self.shaped(run)].factor:.4g}"
                                         if self.shaped(run) else "none")
            lines.append(f"{run.world_size:>3} {run.accum_steps:>3}  {label:<12} {len(run.completions):>5} "
                         f"{run.tokens:>6}  {cells}  {exact}")
        stray = max(r.stray for r in self.runs)
        lines.append(f"gradient outside the sampled tokens: {100 * stray:.2g}% of the total")
        unsure = sum(r.unsure for r in self.runs)
        if unsure:
            lines.append(f"unsure: {unsure} rows end at a forward's last column, and no run's gradient showed whether "
                         "the trainer trains a label beyond such a row: read as ending there")
        lines.append(f"verdict: {self.verdict()}")
        return "\n".join(lines)
