"""The audit reads the exact per-token weights of any loss, and its command fails cleanly.

- Every gradnorm mode's weights, read back from a loss under random ragged plans, equal an oracle
  written out longhand below (loops over ranks and microbatches), not gradnorm's own functions.
- Controls that must fail: the per-microbatch mean is skewed and named `local`; a loss with twice
  the fix's weight is not `token`; a loss that reads padding leaks and equals no mode.
- A KL term (k3) with clip-higher is read exactly on policy; a k1 KL's gradient is separated out.
- The command: exit 0/1 on the catalogue, and one `error:` line (exit 2, no traceback) for every
  broken contract, run as `python -m gradnorm.audit` in fresh interpreters.
- Importing `gradnorm.audit` loads no DDP/FSDP code of its own and none of gradnorm's
  distributed modules.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from gradnorm.audit import conventions, decide, measurement, synthetic
from gradnorm.audit.cli import main
from gradnorm.core.grpo import grpo_token_losses

ROOT = Path(__file__).resolve().parents[3]
BATCH = synthetic.synthetic_minibatch(48, group_size=6, max_new_tokens=40, seed=1)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_plan(num_sequences, world_size, accum_steps, seed):
    """A random assignment with ragged microbatches: random order, random cut points, none empty."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_sequences, generator=gen)
    bins = world_size * accum_steps
    cuts = sorted((torch.randperm(num_sequences - 1, generator=gen)[: bins - 1] + 1).tolist())
    chunks = [order[a:b] for a, b in zip([0, *cuts], [*cuts, num_sequences])]
    return [chunks[r * accum_steps : (r + 1) * accum_steps] for r in range(world_size)]


def oracle(mode, mask, group_ids, plan, constant=None):
    """w[i, t] of docs/design.md's table, longhand: loops over ranks, microbatches and sequences."""
    num_sequences = mask.shape[0]
    world_size, accum_steps = len(plan), len(plan[0])
    length = [int(mask[i].sum()) for i in range(num_sequences)]
    n_total = sum(length)
    s_active = sum(1 for n in length if n > 0)
    group_total = {}
    for i in range(num_sequences):
        group_total[int(group_ids[i])] = group_total.get(int(group_ids[i]), 0) + length[i]
    g_active = sum(1 for n in group_total.values() if n > 0)
    w = torch.zeros(mask.shape, dtype=torch.float64)
    for r in range(world_size):
        for m in range(accum_steps):
            microbatch = plan[r][m].tolist()
            n_rm = sum(length[i] for i in microbatch)
            for i in microbatch:
                if mode == "local":
                    weight = 1 / (world_size * accum_steps * n_rm)
                elif mode == "token":
                    weight = 1 / n_total
                elif mode == "sequence":
                    weight = 1 / (s_active * length[i])
                elif mode == "group":
                    weight = 1 / (g_active * group_total[int(group_ids[i])])
                else:
                    weight = 1 / constant
                for t in range(mask.shape[1]):
                    if mask[i, t]:
                        w[i, t] = weight
    return w


LOSS_OF_MODE = {
    "local": conventions.microbatch_token_mean,
    "token": conventions.token_sum_over_global_count,
    "sequence": conventions.sequence_mean_then_batch_mean,
    "group": conventions.group_mean_then_mean_of_groups,
    "constant": conventions.token_sum_over_constant,
}


@pytest.mark.parametrize("mode", list(LOSS_OF_MODE))
def test_reads_the_exact_weights_of_every_mode_under_random_ragged_plans(mode):
    for seed, (world_size, accum_steps) in enumerate([(3, 2), (2, 4), (4, 1)]):
        plan = random_plan(len(BATCH.mask), world_size, accum_steps, seed)
        read = measurement.measure(LOSS_OF_MODE[mode], BATCH, plan).weights
        expected = oracle(mode, BATCH.mask, BATCH.group_ids, plan, conventions.DR_GRPO_CONSTANT)
        assert_close(read, expected, rtol=1e-12, atol=0)
        # The control: on a ragged plan every other mode's oracle is far off.
        for other in set(LOSS_OF_MODE) - {mode}:
            wrong = oracle(other, BATCH.mask, BATCH.group_ids, plan, conventions.DR_GRPO_CONSTANT)
            assert (read - wrong).abs().max() > 0.05 * wrong.abs().max(), (mode, other)


def test_the_audit_classifies_under_random_plans_and_checks_each_against_gradnorm():
    plans = {"reference": [[torch.arange(48)]]}
    plans |= {f"random {k}": random_plan(48, 2, 3, 10 + k) for k in range(3)}
    for mode, loss in LOSS_OF_MODE.items():
        report = decide.audit_plans(loss, BATCH, plans)
        assert report.equals == mode and report.distance[mode] < 1e-12
        assert report.invariant == (mode != "local")
    assert decide.audit_plans(LOSS_OF_MODE["constant"], BATCH, plans).constant == pytest.approx(4096, rel=1e-12)


def masked_mean(logp, old_logp, advantages, mask):  # the loop divides by A, as most loops do
    return conventions.microbatch_token_mean(logp, old_logp, advantages, mask, accum_steps=1)


def sum_over_count(logp, old_logp, advantages, mask, *, num_tokens):  # no W: gradients are summed
    return conventions.token_sum_over_global_count(logp, old_logp, advantages, mask, num_tokens=num_tokens,
                                                   world_size=1)


def test_the_outer_loop_is_part_of_the_weight():
    plan = random_plan(len(BATCH.mask), 3, 2, seed=7)
    local, token = (oracle(m, BATCH.mask, BATCH.group_ids, plan) for m in ("local", "token"))
    by_accum, summed = measurement.Convention(scale_by_accum=True), measurement.Convention(reduction="sum")
    assert_close(measurement.measure(masked_mean, BATCH, plan, by_accum).weights, local, rtol=1e-12, atol=0)
    assert_close(measurement.measure(sum_over_count, BATCH, plan, summed).weights, token, rtol=1e-12, atol=0)
    # The controls: the same code under the other loop is off by A = 2 and by W = 3.
    assert_close(measurement.measure(masked_mean, BATCH, plan).weights, 2 * local, rtol=1e-12, atol=0)
    assert_close(measurement.measure(sum_over_count, BATCH, plan).weights, token / 3, rtol=1e-12, atol=0)


def test_the_per_microbatch_mean_is_skewed_and_named_local():
    report = decide.audit(conventions.microbatch_token_mean, (4,), (2,))
    assert not report.invariant and report.exit_code == 1
    assert report.equals == "local" and report.matches == ["local"]
    assert report.change > 1  # some token's weight more than doubles against one process
    length = next(r for r in report.results if r.label == "length")  # rank 0 holds the shortest
    assert length.update_share[0] == pytest.approx(1 / 4) and length.token_share[0] < 0.1


def twice_the_fix(logp, old_logp, advantages, mask, *, num_tokens, world_size):
    return 2 * conventions.token_sum_over_global_count(logp, old_logp, advantages, mask, num_tokens=num_tokens,
                                                       world_size=world_size)


def test_control_a_wrong_weight_2_over_n_is_not_token():
    report = decide.audit(twice_the_fix, (2,), (2,))
    assert report.invariant and "token" not in report.matches
    assert report.distance["token"] == pytest.approx(1.0)
    assert report.equals == "constant" and report.constant == pytest.approx(int(report.batch.mask.sum()) / 2)


def grpo_kl_loss(logp, old_logp, advantages, mask, *, ref_logp, num_tokens, world_size, estimator="k3"):
    terms = grpo_token_losses(logp, old_logp, advantages, ref_logp=ref_logp, beta=0.05, clip_low=0.2,
                              clip_high=0.28, kl_estimator=estimator)
    return torch.where(mask, terms.loss, 0.0).sum() / num_tokens * world_size


def grpo_k1_loss(logp, old_logp, advantages, mask, *, ref_logp, num_tokens, world_size):
    return grpo_kl_loss(logp, old_logp, advantages, mask, ref_logp=ref_logp, num_tokens=num_tokens,
                        world_size=world_size, estimator="k1")


def test_kl_k3_and_clip_higher_on_policy_are_read_exactly():
    report = decide.audit(grpo_kl_loss, (2, 4), (1, 2))
    assert report.equals == "token" and report.invariant and report.residual < 1e-12
    # k1's gradient (beta per token) does not vanish on policy; the two signs of A separate it out.
    k1 = decide.audit(grpo_k1_loss, (2,), (2,))
    assert k1.equals == "token" and k1.residual > 0.01
    res = k1.results[-1]
    naive = res.weights - res.residual / k1.batch.advantages.unsqueeze(-1)  # -g(+A) / A alone
    token = oracle("token", k1.batch.mask, k1.batch.group_ids, res.plan)
    assert (naive - token).abs().max() > 0.01 * token.max()  # the control: one sign is not enough


def ignores_the_mask(logp, old_logp, advantages, mask, *, num_tokens, world_size):
    ratio = torch.exp(logp - old_logp)  # (n, T): padding included, the bug
    return -(ratio * advantages.unsqueeze(-1)).sum() / num_tokens * world_size


def test_a_loss_that_reads_padding_leaks_and_equals_no_mode():
    report = decide.audit(ignores_the_mask, (2,), (2,))
    assert report.leak > 0.5 and report.leaks and report.exit_code == 1
    assert report.equals is None and report.invariant  # invariant weights, but on the wrong tokens
    assert decide.audit(conventions.token_sum_over_global_count, (2,), (2,)).leak == 0  # the control


def test_the_synthetic_minibatch_is_ragged_signed_and_seeded():
    b = synthetic.synthetic_minibatch(64, group_size=8, max_new_tokens=64, seed=0)
    lengths = b.mask.sum(-1)
    assert lengths.min() >= 1 and lengths.max() / lengths.min() >= 16
    grouped = b.advantages.reshape(-1, 8)
    assert (b.advantages.abs() >= 0.1).all() and ((grouped > 0).any(1) & (grouped < 0).any(1)).all()
    assert torch.equal(b.logp, synthetic.synthetic_minibatch(64, 8, 64, 0).logp)
    assert synthetic.minibatch_size([32], 8) == 64 and synthetic.minibatch_size([4, 6], 5) == 60


CATALOGUE_ARGS = ["--world-size", "8", "--accum-steps", "4"]
EXPECTED_EXIT = {
    "microbatch_token_mean": 1, "sequence_mean_then_batch_mean": 0, "token_sum_over_constant": 0,
    "token_sum_over_global_count": 0, "group_mean_then_mean_of_groups": 0, "microbatch_mean_of_sequence_means": 1,
    "row_mean_over_packs": 1, "sequence_mean_inside_packs": 0, "context_parallel_chunk_mean": 1,
    "pipeline_mean_of_token_means": 1, "gspo_sequence_ratio": 0, "cispo_clipped_weight": 0,
    "dapo_generation_window_count": 1,
}  # each audited with the flags of its splits (conventions.AXES)


def test_packing_by_tokens_is_what_skews_the_mean_of_sequence_means(capsys):
    args = ["gradnorm.audit.conventions:microbatch_mean_of_sequence_means", *CATALOGUE_ARGS, "--sharding"]
    assert main([*args, "length", "interleave", "contiguous"]) == 0
    assert "equals gradnorm's `sequence`" in capsys.readouterr().out
    assert main([*args, "balanced"]) == 1
    assert "equals no gradnorm mode" in capsys.readouterr().out


BROKEN = '''
import torch

def wrong_shape(logp, old_logp, advantages, mask):
    return -(torch.exp(logp - old_logp) * advantages[:, None])  # (n, T): forgot to reduce

def returns_float(logp, old_logp, advantages, mask):
    return 0.5

def nan(logp, old_logp, advantages, mask):
    return (logp * advantages[:, None]).sum() * float("nan")

def detached(logp, old_logp, advantages, mask):
    return -(logp.detach() * advantages[:, None]).sum().requires_grad_()

def raises(logp, old_logp, advantages, mask):
    raise KeyError("num_items_in_batch\\nsecond line")

def asks_unknown(logp, old_logp, advantages, mask, beta_schedule):
    return logp.sum()
'''

# (argv after the module, what the single error line must say): one per kind of break.
BREAKS = {
    "unimportable module": (["no_such_package_xyz.loss:f"], "cannot import no_such_package_xyz.loss"),
    "missing function": (["gradnorm.audit.conventions:no_such_loss"], "has no function 'no_such_loss'"),
    "missing file": (["missing_dir/loss.py:f"], "no such file"),
    "raises, from a file path": (["{broken}:raises"], "raised KeyError"),
    "wrong return shape": (["{broken}:wrong_shape"], "scalar"),
    "not a tensor": (["{broken}:returns_float"], "got float"),
    "NaN": (["{broken}:nan"], "returned nan"),
    "not differentiable": (["{broken}:detached"], "not differentiable"),
    "unknown argument": (["{broken}:asks_unknown"], "beta_schedule"),
    "bad flag": (["gradnorm.audit.conventions:microbatch_token_mean", "--world-size", "0"], "--world-size"),
    "bad choice": (["gradnorm.audit.conventions:microbatch_token_mean", "--sharding", "diagonal"], "diagonal"),
    "no loss given": (["--world-size", "2"], "required"),
}
# One fresh interpreter checks the imports, then runs the command once per case exactly as
# `python -m gradnorm.audit` does (runpy.run_module as __main__), so torch is imported once, not
# once per case. Real `python -m gradnorm.audit` launches check the entry point itself below.
DRIVER = """
import contextlib, io, json, runpy, sys, traceback
import torch
before = set(sys.modules)
import gradnorm.audit
added = set(sys.modules) - before
imports = sorted(m for m in added if m.startswith(("torch.nn.parallel", "torch.distributed", "matplotlib",
                                                   "gradnorm.dist", "gradnorm.core.accumulate")))
imports += [m for m in ("torch.distributed.fsdp",) if m in sys.modules]
runs = {}
for case, args in json.loads(sys.argv[1]).items():
    for name in ("gradnorm.audit", "gradnorm.audit.cli"):  # every run starts as a fresh `python -m`
        sys.modules.pop(name, None)
    sys.argv = ["gradnorm.audit", *args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("gradnorm.audit", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = stop.code
        except BaseException:
            traceback.print_exc()
            code = "uncaught"
    runs[case] = [code, out.getvalue(), err.getvalue()]
print(json.dumps({"imports": imports, "runs": runs}))
"""


def _python(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def command_runs(tmp_path_factory):
    """Every command run of this module, launched together: one driver and two real `-m` runs."""
    broken = tmp_path_factory.mktemp("losses") / "broken.py"
    broken.write_text(textwrap.dedent(BROKEN))
    cases = {case: [a.format(broken=broken) for a in args] for case, (args, _) in BREAKS.items()}
    cases |= {name: [f"gradnorm.audit.conventions:{name}", *CATALOGUE_ARGS, *conventions.AXES.get(name, ())]
              for name in EXPECTED_EXIT}
    procs = {
        "driver": _python("-c", DRIVER, json.dumps(cases)),
        "real error": _python("-m", "gradnorm.audit", *cases["raises, from a file path"]),
        "real 1": _python("-m", "gradnorm.audit", *cases["microbatch_token_mean"]),
    }
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        done[name] = (proc.returncode, out, err)
    code, out, err = done.pop("driver")
    assert code == 0, err
    return json.loads(out), done


@pytest.mark.launch
def test_importing_the_audit_loads_no_distributed_code_of_its_own(command_runs):
    # `import torch` itself loads torch.nn.parallel (DDP's module, via torch.nn) in torch 2.x, so
    # the check is on what importing gradnorm.audit adds on top of torch, plus gradnorm's own modules.
    driver, _ = command_runs
    assert driver["imports"] == []


@pytest.mark.launch
@pytest.mark.parametrize("case", list(BREAKS))
def test_every_broken_contract_is_one_error_line(case, command_runs):
    code, out, err = command_runs[0]["runs"][case]
    assert code == 2 and out == "", (code, out, err)
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert BREAKS[case][1] in err, err


@pytest.mark.launch
def test_the_command_exits_0_or_1_on_the_catalogue(command_runs):
    assert set(EXPECTED_EXIT) == set(conventions.CATALOGUE)
    for name, expected in EXPECTED_EXIT.items():
        code, out, err = command_runs[0]["runs"][name]
        assert code == expected and err == "", (name, err)
        assert out.splitlines()[-1].startswith("verdict: " + ("INVARIANT" if expected == 0 else "SKEWED"))


@pytest.mark.launch
def test_the_real_entry_point(command_runs):
    real = command_runs[1]
    code, out, err = real["real error"]
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "raised KeyError" in err
    assert "Traceback" not in err
    assert real["real 1"][0] == 1 and "equals gradnorm's `local`" in real["real 1"][1]
    # The command's output is what the module computes in-process, and what the README pastes.
    assert real["real 1"][1] == command_runs[0]["runs"]["microbatch_token_mean"][1]
    assert f"```text\n{real['real 1'][1]}```" in (ROOT / "README.md").read_text()


def test_the_picture_shows_the_weights_it_was_given(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from gradnorm.audit import plot as auditplot

    report = decide.audit(conventions.microbatch_token_mean, (2,), (2,), ("length",))
    res = report.results[-1]
    fig = Figure()
    ax_map, ax_share = fig.subplots(1, 2)
    image = auditplot.plot_weight_map(ax_map, report.batch, res)
    values = image.get_array()
    sequence, rank, _ = auditplot.plan_rows(res)
    assert list(rank) == sorted(rank) and sorted(sequence) == list(range(len(sequence)))
    n = float(report.batch.mask.sum())
    first = int(sequence[0])  # rank 0's first microbatch: the shortest responses, the largest weight
    assert values[0, 0] == pytest.approx(float(res.weights[first, 0]) * n) and values[0, 0] > 1
    assert int(np.isfinite(np.ma.filled(values, np.nan)).sum()) == int(report.batch.mask.sum())  # padding blank
    bars = auditplot.plot_rank_shares(ax_share, res)
    assert [b.get_height() for b in bars["update"]] == pytest.approx(res.update_share.tolist())
    assert [b.get_height() for b in bars["tokens"]] == pytest.approx(res.token_share.tolist())
    fig.savefig(tmp_path / "audit.png")
