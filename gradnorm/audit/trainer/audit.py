"""The trainer audit: a real trainer's per-token weights under several (W, A), in the loss audit's report.

``audit_trainer`` writes the probe model and data set into a temporary folder, trains the user's
trainer on them once per configuration (``gradnorm.audit.trainer.launch``): first one process with one
microbatch holding the whole data set (the reference), then each (W, A) asked for, every rank
reading ``per_device_batch = size / (W * A)`` units per microbatch. Each run's weights come out of
the probe's gradient (``gradnorm.audit.trainer.readout``), and ``gradnorm.audit.decide`` compares them with
the reference and with gradnorm's modes, exactly as it does a loss's: the same Report, verdict and
exit status.

A GRPO trainer samples its own completions, so each run trains on a batch of its own: its runs
are compared with gradnorm's modes on their own batches instead (``gradnorm.audit.trainer.generated``),
with the probe's reward handed to the build as ``reward_func``. ``units`` then counts the
completions of one optimizer step, two a prompt; the data set holds ``units`` prompts, room for a
generation batch of up to two optimizer steps.

``audit_script`` runs a command as the user typed it, once. It has no reference run of its own, so
its reference is the objective's global mean over the data set (SFT: 1/N on every label token;
DPO: 1/P on every pair), what one process on the whole batch gives with the standard loss.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gradnorm.audit.decide import Report, decide
from gradnorm.audit.measurement import Convention, Result
from gradnorm.audit.objectives import DEFAULT_BETA, get, mode_weights, slopes
from gradnorm.audit.synthetic import SyntheticBatch
from gradnorm.audit.trainer.data import ProbeData, dpo_data, grpo_prompts, sft_data
from gradnorm.audit.trainer.generated import GeneratedReport, read_generated
from gradnorm.audit.trainer.launch import Configuration, TrainerError, run_build, run_script
from gradnorm.audit.trainer.model import write_probe
from gradnorm.audit.trainer.readout import Readout, ReadoutError, read

DATA = {"sft": sft_data, "dpo": dpo_data, "grpo": grpo_prompts}
TOLERANCE = 1e-5
"""Relative. The probe's gradient is fp32 (a unit roundoff of 6e-8 a weight) summed over a trainer's own
fp32 arithmetic, which the tests hold every trainer measured to; a bfloat16 head (TRL's default
bf16=True on a CPU) rounds by 2^-8 = 4e-3 and a skew of this class is 1e-2 or more, both far above."""


@dataclass
class Probe:
    """The probe model and data set, written once into ``folder``."""

    data: ProbeData
    folder: Path

    @property
    def model_path(self) -> Path:
        return self.folder / "probe"

    @property
    def data_path(self) -> Path:
        return self.folder / "data.jsonl"

    @classmethod
    def write(cls, objective: str, units: int, folder: Path) -> Probe:
        if objective not in DATA:
            raise TrainerError(f"the trainer audit reads SFT, DPO and GRPO trainers (--objective sft, dpo or grpo), "
                               f"not {objective!r}")
        data = DATA[objective](units)
        write_probe(folder / "probe", data.vocab_size, generating=objective == "grpo")
        data.write_jsonl(folder / "data.jsonl")
        return cls(data, folder)


def configurations(units: int, world_sizes: Sequence[int], accum_steps: Sequence[int]) -> list[Configuration]:
    """The reference (1, 1, units), then every (W, A) asked for; each W * A must divide ``units``."""
    configs = [Configuration(1, 1, units)]
    for W in world_sizes:
        for A in accum_steps:
            if units % (W * A):
                raise TrainerError(f"W={W} x A={A} does not divide the probe's {units} units: choose sizes whose "
                                   "product divides it (or --units)")
            if (W, A) != (1, 1):
                configs.append(Configuration(W, A, units // (W * A)))
    if len(configs) == 1:
        raise TrainerError("only the reference (W=1, A=1) was asked for: give --world-size or --accum-steps above 1")
    return configs


def _batch(data: ProbeData, mask: torch.Tensor) -> SyntheticBatch:
    """The audit's view of the probe data set: its rows, the slots the loss should count, its units."""
    rows = len(data.rows)
    unit_size = 2 if data.objective == "dpo" else 1
    return SyntheticBatch(logp=torch.zeros(mask.shape, dtype=torch.float64), mask=mask,
                          advantages=torch.ones(rows, dtype=torch.float64),
                          group_ids=torch.tensor(data.units), group_size=unit_size)


def _result(label: str, readout: Readout, batch: SyntheticBatch, objective: str, beta: float) -> Result:
    weights = readout.values / slopes(get(objective), batch.advantages, beta).unsqueeze(-1)
    total = weights.sum()
    tokens = batch.mask.sum()
    owner = [torch.cat(rank) if rank else torch.zeros(0, dtype=torch.long) for rank in readout.plan]
    update = torch.stack([weights[rows].sum() for rows in owner]) / (total if total != 0 else 1.0)
    share = torch.stack([batch.mask[rows].sum() for rows in owner]).double() / tokens
    return Result(label, readout.plan, weights, torch.zeros_like(weights), update_share=update, token_share=share)


@dataclass
class TrainerReport:
    """A trainer's audit: the loss audit's Report (SFT, DPO) or a GeneratedReport (GRPO), and what only a
    trainer run shows."""

    report: Report | GeneratedReport
    stray: float  # the largest share of gradient outside the data's tokens (prompt, padding) over the runs
    ranks_disagree: list[str]  # configurations whose ranks stepped with different gradients

    @property
    def exit_code(self) -> int:
        return 1 if self.ranks_disagree else self.report.exit_code


def _report(name: str, probe: Probe, runs: list[tuple[str, Readout]], beta: float,
            reference: Result | None = None) -> TrainerReport:
    objective = probe.data.objective
    batch = _batch(probe.data, runs[0][1].mask)
    results = ([reference] if reference else []) + [_result(label, r, batch, objective, beta) for label, r in runs]
    report = decide(name, batch, results, objective=objective, tol=TOLERANCE, beta=beta,
                    convention=Convention(measured=True))
    return TrainerReport(report, max(r.stray for _, r in runs), [label for label, r in runs if not r.ranks_agree])


def audit_trainer(build: str, objective: str = "sft", world_sizes: Sequence[int] = (1, 2),
                  accum_steps: Sequence[int] = (2,), units: int = 16, beta: float = DEFAULT_BETA,
                  timeout: float = 300.0, keep: Path | None = None,
                  progress: Callable[[str], None] = lambda line: None) -> TrainerReport:
    """Audit the trainer that ``build`` (``file.py:function`` or ``module:function``) returns; see the module docstring."""
    configs = configurations(units, world_sizes, accum_steps)
    with _workdir(keep) as folder:
        probe = Probe.write(objective, units, folder)
        runs = []
        for i, config in enumerate(configs):
            progress(f"[{i + 1}/{len(configs)}] training under {config.title}"
                     + (" (the reference)" if i == 0 else ""))
            records = run_build(build, config, probe.model_path, probe.data_path, probe.data.vocab_size,
                                folder / f"run{i}", timeout)
            runs.append((config.label, _read(probe.data, records)))
        if objective == "grpo":
            report = GeneratedReport(build, [label for label, _ in runs], [run for _, run in runs], TOLERANCE)
            return TrainerReport(report, max(r.stray for _, r in runs), [l for l, r in runs if not r.ranks_agree])
        return _report(build, probe, runs, beta)


def audit_script(command: list[str], objective: str = "sft", units: int = 16, beta: float = DEFAULT_BETA,
                 timeout: float = 300.0, keep: Path | None = None,
                 progress: Callable[[str], None] = lambda line: None) -> TrainerReport:
    """Audit the command ``command`` (placeholders {model}, {data}, {output_dir}); see the module docstring."""
    if objective == "grpo":
        raise TrainerError("a GRPO trainer is audited with --trainer: its build takes the probe's reward "
                           "(reward_func), which a script has no way to be handed")
    with _workdir(keep) as folder:
        probe = Probe.write(objective, units, folder)
        progress(f"running {' '.join(command)}")
        records = run_script(command, probe.model_path, probe.data_path, probe.data.vocab_size, folder / "run",
                             timeout)
        readout = _read(probe.data, records)
        label = "the script"
        reference = _global_mean(probe.data, readout.mask)
        return _report(" ".join(command), probe, [(label, readout)], beta, reference)


def _global_mean(data: ProbeData, mask: torch.Tensor) -> Result:
    """The reference of a script: the objective's global mean on one process (SFT 1/N a token, DPO 1/P a pair)."""
    objective = get(data.objective)
    mode = "pair" if data.objective == "dpo" else "token"
    plan = [[torch.arange(len(mask))]]
    weights = mode_weights(objective, mode, mask, torch.tensor(data.units), len(set(data.units)), plan, 0.0)
    one = torch.ones(1, dtype=torch.float64)
    return Result(f"{mode} mean", plan, weights, torch.zeros_like(weights),
                  update_share=one, token_share=one)


def _read(data: ProbeData, records: list[dict]):
    try:
        return read_generated(data, records) if data.objective == "grpo" else read(data, records)
    except ReadoutError as err:
        raise TrainerError(str(err)) from None


class _workdir:
    """A temporary folder for the audit's files, removed at the end unless ``keep`` names one to use."""

    def __init__(self, keep: Path | None):
        self.keep = keep

    def __enter__(self) -> Path:
        if self.keep is not None:
            self.keep.mkdir(parents=True, exist_ok=True)
            self.folder = self.keep
        else:
            self.folder = Path(tempfile.mkdtemp(prefix="gradnorm-trainer-audit-"))
        return self.folder

    def __exit__(self, *exc) -> None:
        if self.keep is None:
            shutil.rmtree(self.folder, ignore_errors=True)
