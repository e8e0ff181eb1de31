"""The trainer end to end, with real ``torchrun`` launches of ``gradnorm/train.py`` over gloo.

What must hold, on one tiny config (4 prompts x 4 completions, ragged response lengths):
- the rollout batch of step 1 is bit-identical for every world size, accumulation and sharding,
  under ``--rollouts sharded`` (the default: each of 2 ranks samples 2 of the 4 groups, then one
  all_gather) and ``replicated`` (every rank samples all 4);
- step 1's gradient norm (before clipping) is the same to fp32 rounding for (W, A) = (1,1), (1,4),
  (2,1), (2,2) and every sharding under ``token``, and for (1,1) vs (2,2) sorted by length under
  ``sequence``, ``group`` and a constant C;
- the control: ``local`` with ranks sorted by length differs from the (1,1) run by far more than
  rounding, so these comparisons can fail;
- a run interrupted and resumed from its checkpoint logs exactly the metrics of one that was not;
- every line has the phase times, which add up to the step, with the max over the 2 ranks.

The W = 1 references run the script's ``main()`` in one plain Python process (no torchrun);
every other run of the module's fixture is its own torchrun launch, two at a time (``launch_all``),
and the resume test launches the two halves of its interrupted run itself.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.runfiles import launch_all, metrics
from tests.helpers.trainer import tiny, torchrun_cmd
from torch.testing import assert_close

from gradnorm.trainer.checkpoint import store
from gradnorm.trainer.logs.metrics import TIMING_KEYS
from gradnorm.trainer.logs.phases import MAX_PHASES, PHASES
from gradnorm.trainer.logs.phases import METRIC_KEYS as PHASE_KEYS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# TINY with 4 prompts x 4 completions, a 20-step warm-up, 8 eval prompts and the default model size:
# the runs must learn enough for ragged response lengths, and the references below are these runs
FLAGS = tiny(prompts_per_step="4", group_size="4", warmup_steps="20", eval_prompts="8", n_layer=None, n_embd=None,
             n_head=None)
CONSTANT = "320"  # Dr GRPO's C = S * max_new_tokens = 16 * 20
REFERENCE_MODES = ["token", "sequence", "group", CONSTANT, "local"]
BUDGET = "80"  # tokens per microbatch: prompt 5 + responses of up to 20; ranks hold different counts
PACKED = ["--pack", "--microbatch-tokens", BUDGET, "--shard", "length"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(nproc: int, out: Path, *flags: str) -> None:
    cmd = torchrun_cmd(out, *flags, nproc=nproc, base=FLAGS)
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(mode, W, A, shard): step-1 metrics} for every launch, plus the resume test's directories.

    Every launch samples with the default --rollouts sharded but one, keyed (mode, W, A, shard, "replicated").
    """
    base = tmp_path_factory.mktemp("train")
    # W = 1: one plain Python process runs main() once per mode (A = 1), then token with A = 4.
    script = ("import sys; from gradnorm.train import main\n"
              "for mode in sys.argv[2:]:\n"
              f"    assert main({FLAGS!r} + ['--steps', '1', '--loss-denominator', mode, "
              "'--output-dir', sys.argv[1] + '/' + mode]) == 0\n"
              f"assert main({FLAGS!r} + ['--steps', '1', '--grad-accum-steps', '4', '--shard', 'contiguous', "
              "'--output-dir', sys.argv[1] + '/token-1-4']) == 0\n")
    jobs = [[sys.executable, "-c", script, str(base / "single"), *REFERENCE_MODES]]
    launches = {(mode, 2, accum, shard): ["--loss-denominator", mode, "--grad-accum-steps", str(accum), "--shard", shard]
                for mode, accum, shard in [("token", 1, "interleave"), ("token", 1, "contiguous"), ("token", 2, "balanced"),
                                           ("sequence", 2, "length"), ("group", 2, "length"), (CONSTANT, 2, "length"),
                                           ("local", 2, "length")]}
    launches["token", 2, 2, "balanced", "replicated"] = ["--grad-accum-steps", "2", "--shard", "balanced",
                                                         "--rollouts", "replicated"]
    # local under a token budget: ranks sorted by length hold different numbers of microbatches.
    launches["local", 2, "budget", "length"] = ["--loss-denominator", "local", *PACKED[1:]]
    out = {key: base / "-".join(map(str, key)) for key in launches}
    jobs += [torchrun_cmd(out[key], "--steps", "1", *flags, base=FLAGS)
             for key, flags in launches.items()]
    # token, 2 ranks sorted by length, packed rows in microbatches of at most BUDGET tokens: 4
    # uninterrupted steps, which also serve the resume test.
    full = base / "full"
    jobs.append(torchrun_cmd(full, "--steps", "4", "--save-every", "2", *PACKED, base=FLAGS))
    launch_all(jobs, ROOT, ENV)
    found = {(mode, 1, 1, "interleave"): metrics(base / "single" / mode)[0] for mode in REFERENCE_MODES}
    found["token", 1, 4, "contiguous"] = metrics(base / "single" / "token-1-4")[0]
    found.update({key: metrics(path)[0] for key, path in out.items()})
    found["token", 2, "budget", "length", "pack"] = metrics(full)[0]
    return found, base


def test_step_one_rollouts_are_bit_identical_across_world_size_accumulation_and_sharding(runs):
    found, _ = runs
    digests = {key: m["rollout_digest"] for key, m in found.items()}
    assert ("token", 2, 2, "balanced", "replicated") in digests and ("token", 2, 1, "interleave") in digests
    assert len(set(digests.values())) == 1, digests
    for key, m in found.items():  # the same rollout means the same global token count, however split
        assert sum(m["tokens_per_rank"]) == m["tokens"] == found["token", 1, 1, "interleave"]["tokens"], key


def test_token_grad_norm_is_invariant_to_world_size_accumulation_and_sharding(runs):
    found, _ = runs
    reference = found["token", 1, 1, "interleave"]
    token_runs = {key: m for key, m in found.items() if key[0] == "token"}
    assert {key[1:] for key in token_runs} >= {(1, 1, "interleave"), (1, 4, "contiguous"), (2, 1, "interleave"),
                                               (2, 1, "contiguous"), (2, 2, "balanced"), (2, "budget", "length", "pack")}
    for key, m in token_runs.items():
        assert_close(m["grad_norm"], reference["grad_norm"], rtol=1e-5, atol=0, msg=f"{key}")
        assert_close(m["loss"], reference["loss"], rtol=1e-5, atol=1e-7, msg=f"{key}")


@pytest.mark.parametrize("mode", ["sequence", "group", CONSTANT])
def test_other_invariant_modes_match_one_process_under_length_sorted_ranks(runs, mode):
    found, _ = runs
    single, sharded = found[mode, 1, 1, "interleave"], found[mode, 2, 2, "length"]
    assert_close(sharded["grad_norm"], single["grad_norm"], rtol=1e-5, atol=0)
    assert_close(sharded["loss"], single["loss"], rtol=1e-5, atol=1e-7)


def test_local_differs_when_ranks_hold_ragged_token_counts(runs):
    """The control: the same rollout, the old per-microbatch mean, a clearly different gradient."""
    found, _ = runs
    single, sharded = found["local", 1, 1, "interleave"], found["local", 2, 2, "length"]
    short_rank, long_rank = sharded["tokens_per_rank"]
    assert short_rank < long_rank / 2  # sorting by length really made the ranks unequal
    relative = abs(sharded["grad_norm"] - single["grad_norm"]) / single["grad_norm"]
    assert relative > 0.05, (sharded["grad_norm"], single["grad_norm"])
    # With W = A = 1 local is the global token mean; only the split changes it.
    assert_close(single["grad_norm"], found["token", 1, 1, "interleave"]["grad_norm"], rtol=1e-6, atol=0)


def test_local_under_a_budget_is_the_legacy_dynamic_batch_mean(runs):
    """The control of the packed, budgeted run: the same rollout, local's per-rank microbatch counts."""
    found, _ = runs
    budget = found["local", 2, "budget", "length"]
    assert budget["mb_tokens_min"] < budget["mb_tokens_max"]  # the budget cut microbatches of unequal tokens
    relative = abs(budget["grad_norm"] - found["token", 1, 1, "interleave"]["grad_norm"]) / budget["grad_norm"]
    assert relative > 0.05
    # every line says what local would have done: token's step carries the same skew it shows here
    assert budget["skew_max"] > 1.5 and found["token", 2, "budget", "length", "pack"]["skew_max"] > 1.5


def test_resumed_run_logs_the_same_metrics_as_an_uninterrupted_one(runs):
    """A packed run with a token budget, interrupted after step 3's line and resumed."""
    _, base = runs
    full, resumed = base / "full", base / "resumed"
    flags = ["--save-every", "2", *PACKED]
    torchrun(2, resumed, "--steps", "3", *flags)
    # A crash after step 3 was logged but before its checkpoint: --resume must drop that line.
    shutil.rmtree(resumed / "ckpt_step3")
    torchrun(2, resumed, "--steps", "4", "--resume", *flags)

    def comparable(out):
        return [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in metrics(out)]

    assert [m["step"] for m in comparable(resumed)] == [1, 2, 3, 4]
    assert comparable(resumed) == comparable(full)
    assert sorted(p.name for p in full.glob("ckpt_step*")) == ["ckpt_step2", "ckpt_step4"]
    final = store.read_tensors(full / "ckpt_step4", "model")
    again = store.read_tensors(resumed / "ckpt_step4", "model")
    for name, tensor in final.items():
        assert torch.equal(tensor, again[name]), name


def test_two_ranks_log_every_phase_with_the_max_over_ranks(runs):
    """The phase times of the 2-rank run (gradnorm.trainer.logs.phases): present, adding up, max over ranks >= rank 0's."""
    _, base = runs
    config = json.loads((base / "full" / "config.json").read_text())
    # scoring runs only with rollout reuse or a reference; a phase that does not run is charged nothing
    scores = config["minibatches_per_rollout"] * config["epochs"] > 1 or config["beta"] > 0
    previous = 0.0
    for m in metrics(base / "full"):
        assert set(PHASE_KEYS) <= set(m), m
        assert sum(m[f"time_{p}_s"] for p in PHASES) == pytest.approx(m["elapsed_s"] - previous, rel=1e-9, abs=1e-9)
        for p in MAX_PHASES:
            if p == "scoring" and not scores:
                assert m["time_scoring_max_s"] == m["time_scoring_s"] == 0.0, m
            else:
                assert m[f"time_{p}_max_s"] >= m[f"time_{p}_s"] > 0, (p, m)
        previous = m["elapsed_s"]
