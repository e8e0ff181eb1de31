"""Trainer paths that the default flags never take, end to end: ``--beta > 0`` and rollout reuse.

KL against a reference (``--beta 0.1``), on one tiny config:
- ``kl`` is logged and is in the loss: ``loss = pg_loss + beta * kl`` (token mode: both are token
  means) and KL's gradient moves step 2's gradient norm away from a beta = 0 run's, from the same
  weights and rollout; at step 1 the policy is the reference, so KL is 0 and the runs agree;
- the reference is the policy after warm-up, is frozen, and is saved in every checkpoint;
- a 2-rank run interrupted and resumed logs exactly what an uninterrupted one logs (the reference
  is restored from the checkpoint, not copied from the resumed policy);
- step 1 is invariant to (W, A, sharding) under ``token``, and so is step 2, where KL is not 0:
  both continue one W = 1 checkpoint, so they start from the same weights; the control: ``local``
  continued the same way departs.

Rollout reuse (``--minibatches-per-rollout 2 --epochs 2``: 4 updates per rollout):
- one rollout feeds all 4 steps, the 2nd epoch revisits the 1st epoch's minibatches;
- step 1 is on-policy (nothing clipped); every update of the 2nd epoch clips some tokens;
- the gradient norm of every step is the same for (W, A) = (1, 1) and (2, 2) sorted by length
  under ``token``; the control: ``local`` departs at every step.

The remaining flags that no other test changes, in one run of 2 steps: bf16 autocast on the CPU
(another step-1 gradient than fp32), ``--kl-estimator k2`` (another KL than k3 once the policy
moved), ``--save-every 0`` (a checkpoint at the end only), ``--log-every``, ``--plot``,
``--cpu-threads``, and the optimizer, clip, warm-up and sampling values (they reach config.json).
And a fresh run into a directory that holds a run: refused, and with ``--overwrite`` none of the
old checkpoints survive for a later ``--resume`` to pick.

The (1, 1) runs are ``main()`` in this process; every other run is a torchrun launch (6).
"""

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tests.helpers.runfiles import comparable, launch_all, metrics
from tests.helpers.runfiles import every_file
from tests.helpers.trainer import one_error_line, run_main, tiny, torchrun_cmd
from torch.testing import assert_close

from gradnorm.train import main
from gradnorm.trainer.checkpoint import store
from gradnorm.trainer.config import parse_config
from gradnorm.trainer.policy import build_policy
from gradnorm.trainer.logs.metrics import TIMING_KEYS
from gradnorm.trainer.warmup import warm_up

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# TINY with 4 prompts x 4 completions, a 20-step warm-up, 8 eval prompts and width 32 (the default
# head count): a policy that moves enough for KL and the clip to fire, and the runs compared below
FLAGS = tiny(prompts_per_step="4", group_size="4", warmup_steps="20", eval_prompts="8", n_embd="32", n_head=None)
BETA = 0.1
SHARDED = ["--grad-accum-steps", "2", "--shard", "length"]  # (W, A) = (2, 2), ranks sorted by response length
REUSE = ["--minibatches-per-rollout", "2", "--epochs", "2", "--steps", "4"]


def torchrun(out: Path, *flags: str) -> None:
    launch_all([torchrun_cmd(out, *flags, base=FLAGS)], ROOT, ENV)


def one_process(out: Path, *flags: str) -> None:
    assert run_main(out, *flags, base=FLAGS) == 0


def departs(got: float, reference: float) -> bool:
    """Far outside the rtol of 1e-5 that the invariant runs meet (they agree to a few 1e-7)."""
    return abs(got - reference) / reference > 1e-3


def continued(base: Path, source: str, name: str, *flags: str) -> list[str]:
    """The command for step 2 on 2 ranks x 2 microbatches, continued from the W = 1 run ``source``'s
    step-1 checkpoint (copied to ``base / name``)."""
    out = base / name
    out.mkdir()
    # A bare checkpoint, without config.json, resumes without comparing the flags: the local control
    # changes A and the sharding, which a --resume of a local run refuses (gradnorm.trainer.config).
    shutil.copytree(base / source / "ckpt_step1", out / "ckpt_step1")
    shutil.copy(base / source / "metrics.jsonl", out)
    return torchrun_cmd(out, "--steps", "2", "--resume", *SHARDED, *flags, base=FLAGS)


# ------------------------------------------------------------------ beta > 0


@pytest.fixture(scope="module")
def kl_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("kl")
    beta = ["--beta", str(BETA)]
    # Independent runs overlap (each writes its own directory): the 2-rank run beside the
    # one-process runs in this process, then the two continuations of theirs.
    with ThreadPoolExecutor(1) as beside:
        two = beside.submit(torchrun, base / "two", "--steps", "4", "--save-every", "2", *SHARDED, *beta)
        one_process(base / "one", "--steps", "4", "--save-every", "1", *beta)
        one_process(base / "no_kl", "--steps", "2")
        one_process(base / "one_local", "--steps", "1", "--loss-denominator", "local", *beta)
        launch_all([continued(base, "one", "two_from_one", *beta),
                    continued(base, "one_local", "two_local_from_one", "--loss-denominator", "local", *beta)], ROOT, ENV)
        two.result()
    # Interrupted after step 2: the copy of the 2-rank run loses its step-4 checkpoint, then resumes.
    shutil.copytree(base / "two", base / "resumed")
    shutil.rmtree(base / "resumed" / "ckpt_step4")
    torchrun(base / "resumed", "--steps", "4", "--save-every", "2", "--resume", *SHARDED, *beta)
    return base


def test_kl_is_logged_and_is_in_the_loss_and_in_the_gradient(kl_runs):
    with_kl, without = metrics(kl_runs / "one"), metrics(kl_runs / "no_kl")
    assert all("kl" not in m for m in without)  # beta = 0 loads no reference and logs no KL
    assert with_kl[0]["kl"] == 0.0  # step 1: the policy is the reference
    for m in with_kl[1:]:
        assert m["kl"] > 0, m
        assert_close(m["loss"], m["pg_loss"] + BETA * m["kl"], rtol=1e-6, atol=1e-9, msg=f"step {m['step']}")
    # Step 2 from the same weights and rollout: the same policy loss, a gradient that KL changed.
    assert with_kl[1]["rollout_digest"] == without[1]["rollout_digest"]
    assert_close(with_kl[1]["pg_loss"], without[1]["pg_loss"], rtol=1e-6, atol=0)
    assert departs(with_kl[1]["grad_norm"], without[1]["grad_norm"])
    assert_close(with_kl[0]["grad_norm"], without[0]["grad_norm"], rtol=1e-6, atol=0)


def test_the_reference_is_the_policy_after_warm_up_frozen_and_checkpointed(kl_runs):
    ckpts = [{part: store.read_tensors(kl_runs / "one" / f"ckpt_step{s}", part) for part in ("model", "ref")}
             for s in (1, 2, 3, 4)]
    cfg = parse_config([*FLAGS, "--beta", str(BETA)])
    torch.set_num_threads(cfg.cpu_threads)
    task, built = build_policy(cfg, torch.device("cpu"))
    policy = built.model
    warm_up(policy, task, cfg)
    for name, tensor in policy.state_dict().items():
        assert torch.equal(ckpts[0]["ref"][name], tensor), name
        assert all(torch.equal(c["ref"][name], tensor) for c in ckpts[1:]), name  # frozen
    moved = [name for name in ckpts[3]["model"] if not torch.equal(ckpts[3]["model"][name], ckpts[3]["ref"][name])]
    assert moved, "the policy should have left the reference after 4 steps"
    with pytest.raises(ValueError, match="holds no ref tensors"):  # beta = 0 saves no reference
        store.read_tensors(kl_runs / "no_kl" / "ckpt_step2", "ref")


def test_a_resumed_kl_run_logs_what_an_uninterrupted_one_logs(kl_runs):
    resumed, full = comparable(kl_runs / "resumed"), comparable(kl_runs / "two")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert all(m["kl"] > 0 for m in resumed[1:])
    assert resumed == full


def test_resuming_a_run_without_a_reference_with_beta_is_one_line(kl_runs, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(kl_runs / "no_kl", out)
    assert main([*FLAGS, "--output-dir", str(out), "--steps", "4", "--resume", "--beta", str(BETA)]) != 0
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--beta" in errors[0] and "Traceback" not in err, err


def test_token_with_kl_is_invariant_to_world_size_accumulation_and_sharding(kl_runs):
    one, two = metrics(kl_runs / "one"), metrics(kl_runs / "two")
    from_one, local = metrics(kl_runs / "two_from_one"), metrics(kl_runs / "two_local_from_one")
    assert two[0]["rollout_digest"] == one[0]["rollout_digest"]
    assert_close(two[0]["grad_norm"], one[0]["grad_norm"], rtol=1e-5, atol=0)
    # Step 2, from the same weights: KL is not 0, and the gradient is still the one-process one.
    short_rank, long_rank = from_one[1]["tokens_per_rank"]
    assert short_rank < long_rank / 2  # the ranks really are unequal
    assert from_one[1]["rollout_digest"] == one[1]["rollout_digest"] and from_one[1]["kl"] > 0
    for key in ("grad_norm", "loss", "kl"):
        assert_close(from_one[1][key], one[1][key], rtol=1e-5, atol=1e-8, msg=key)
    # The control: the same continuation under local departs from the one-process gradient.
    assert local[1]["rollout_digest"] == one[1]["rollout_digest"]
    assert departs(local[1]["grad_norm"], one[1]["grad_norm"])


# ------------------------------------------------------------------ rollout reuse


@pytest.fixture(scope="module")
def reuse_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("reuse")
    with ThreadPoolExecutor(1) as beside:  # the two launches, two at a time, beside the one-process run
        launched = beside.submit(launch_all, [torchrun_cmd(base / "two", *REUSE, *SHARDED, base=FLAGS),
                                              torchrun_cmd(base / "two_local", *REUSE, *SHARDED, "--loss-denominator", "local", base=FLAGS)],
                                 ROOT, ENV)
        one_process(base / "one", *REUSE)
        launched.result()
    return {name: metrics(base / name) for name in ("one", "two", "two_local")}


def test_one_rollout_feeds_two_epochs_of_two_minibatches(reuse_runs):
    rows = reuse_runs["one"]
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    assert len({m["rollout_digest"] for m in rows}) == 1
    tokens = [m["tokens"] for m in rows]
    assert tokens[0] != tokens[1] and tokens[2:] == tokens[:2]  # epoch 2 revisits minibatches 0 and 1


def test_the_clip_fires_once_the_policy_has_moved(reuse_runs):
    clipfrac = [m["clipfrac"] for m in reuse_runs["one"]]
    assert clipfrac[0] == 0.0  # on-policy: every ratio is exactly 1
    assert all(c > 0 for c in clipfrac[2:]), clipfrac  # the 2nd epoch: ratios left [0.8, 1.28]


def test_reused_rollouts_keep_token_invariant_and_local_departs(reuse_runs):
    one, two, local = reuse_runs["one"], reuse_runs["two"], reuse_runs["two_local"]
    for a, b, c in zip(one, two, local):
        assert a["rollout_digest"] == b["rollout_digest"] == c["rollout_digest"]
        for key in ("grad_norm", "loss"):
            assert_close(b[key], a[key], rtol=1e-5, atol=1e-8, msg=f"step {a['step']} {key}")
        assert departs(c["grad_norm"], a["grad_norm"]), a["step"]


# ------------------------------------------------------------------ the remaining flags, each taking effect

EVERY_FLAG = ["--steps", "2", "--precision", "bf16", "--beta", "0.05", "--kl-estimator", "k2",
              "--no-scale-adv-by-std", "--weight-decay", "0.01", "--save-every", "0", "--cpu-threads", "2",
              "--warmup-batch", "8", "--warmup-lr", "1e-3", "--temperature", "0.7", "--clip-low", "0.1",
              "--clip-high", "0.1", "--max-grad-norm", "0.5", "--log-every", "1", "--plot", "--device", "cpu"]


def test_the_flags_no_other_test_changes_take_effect(tmp_path, capsys):
    """bf16 autocast on the CPU, the k2 estimator, save-every 0, the log lines and the curve, threads."""
    pytest.importorskip("matplotlib")
    runs = {}
    try:
        for name, extra in [("all", []), ("fp32", ["--precision", "fp32"]), ("k3", ["--kl-estimator", "k3"])]:
            capsys.readouterr()
            one_process(tmp_path / name, *EVERY_FLAG, *extra)
            runs[name] = (metrics(tmp_path / name), capsys.readouterr().out)
            assert torch.get_num_threads() == 2  # --cpu-threads
    finally:
        torch.set_num_threads(1)
    rows, out = runs["all"]
    out_dir = tmp_path / "all"
    assert [m["step"] for m in rows] == [1, 2] and all(m["grad_norm"] > 0 for m in rows)
    assert sorted(p.name for p in out_dir.glob("*ckpt_step*")) == ["ckpt_step2"]  # --save-every 0: the end only
    assert (out_dir / "learning_curve.png").stat().st_size > 0  # --plot
    assert "step 1/2 " in out and "step 2/2 " in out  # --log-every 1 (no terminal here, so no progress bar)
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["precision"], config["kl_estimator"], config["save_every"]) == ("bf16", "k2", 0)
    # bf16 matmuls round differently from fp32 ones: the same run in fp32 has another step-1 gradient
    # (not another loss: on-policy, the ratio is exactly 1 and J does not depend on the log-probs).
    fp32 = runs["fp32"][0]
    assert fp32[0]["grad_norm"] != rows[0]["grad_norm"]
    # k2 and k3 agree where the policy is the reference (step 1) and differ once it moved (step 2).
    k3 = runs["k3"][0]
    assert k3[0] == {**rows[0], **{k: k3[0][k] for k in TIMING_KEYS if k in k3[0]}}
    assert k3[1]["kl"] > 0 and rows[1]["kl"] > 0 and k3[1]["kl"] != rows[1]["kl"]


def test_a_fresh_run_never_mixes_with_the_run_already_in_its_output_dir(tmp_path, capsys):
    """A later --resume must continue one run: a fresh run refuses a directory that holds a run, and
    with --overwrite none of the old checkpoints survive, not even those past the new run's last step."""
    out = tmp_path / "run"
    one_process(out, "--steps", "2", "--save-every", "1")
    old = every_file(out)
    capsys.readouterr()
    assert main([*FLAGS, "--output-dir", str(out), "--steps", "1"]) == 2
    one_error_line(capsys.readouterr().err, f"--output-dir {out} holds a run (")
    assert every_file(out) == old  # refused before anything was touched
    one_process(out, "--steps", "1", "--seed", "5", "--overwrite")
    # The old ckpt_step2 would be what --resume picks: it went with previous_run/ at the new run's checkpoint.
    assert sorted(os.listdir(out)) == [".gradnorm-run", "ckpt_step1", "config.json", "metrics.jsonl", "warmup.json"]
    assert store.latest_checkpoint(out) == out / "ckpt_step1"
    assert [m["step"] for m in metrics(out)] == [1]
    assert json.loads((out / "config.json").read_text())["seed"] == 5
