"""The trainer's parts, fast: config errors, --help, the response mask, rollouts, checkpoints, the curve.

The command-line checks run ``python gradnorm/train.py`` as a script (the way torchrun runs it,
with gradnorm/ first on sys.path), not ``python -m``.
"""

import dataclasses
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradnorm.core.sharding import make_plan
from gradnorm.dist import state as dist_state
from gradnorm.models.tinygpt import GPTConfig, TinyGPT
from gradnorm.tasks import RepeatTask
from gradnorm.teach.runs import moving_average
from gradnorm.trainer.checkpoint import store
from gradnorm.trainer.config import TrainConfig, build_parser, field_docs, parse_config
from gradnorm.trainer.policy import TinyGPTPolicy
from gradnorm.trainer.rollout import generate_rollout, response_mask, seeded_generator
from gradnorm.trainer.logs.curves import plot_learning_curve, write_learning_curve

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_script(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "gradnorm/train.py", *flags], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------ configuration and the CLI


@pytest.mark.launch
@pytest.mark.parametrize("flags, says", [
    (["--loss-denominator", "mean"], "invalid loss denominator 'mean'"),
    (["--prompts-per-step", "3", "--group-size", "3", "--grad-accum-steps", "2"], "cannot be split over 1 ranks x 2"),
    (["--group-size", "1"], "--group-size must be >= 2"),
])
def test_a_bad_config_is_one_line_on_stderr_and_exit_code_2(flags, says, tmp_path):
    proc = run_script(*flags, "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert says in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was built or written


@pytest.mark.launch
def test_help_documents_every_flag():
    proc = run_script("--help")
    assert proc.returncode == 0
    required = ["--loss-denominator", "--grad-accum-steps", "--seed", "--steps", "--output-dir", "--shard",
                "--beta", "--save-every", "--resume"]
    for flag in required + ["--" + f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)]:
        assert flag in proc.stdout, flag
    assert "{local,token,sequence,group,<number>}" in proc.stdout
    assert "{interleave,contiguous,length,balanced}" in proc.stdout


def test_every_config_field_has_a_docstring_and_defaults_validate():
    docs = field_docs()
    assert set(docs) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert all(len(doc) > 10 for doc in docs.values())
    TrainConfig().validate(world_size=2)  # the README's default run is valid on 2 ranks


def test_validation_covers_world_size_and_rollout_reuse():
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        parse_config([], world_size=3)
    with pytest.raises(ValueError, match="multiples of minibatches-per-rollout"):
        parse_config(["--minibatches-per-rollout", "2", "--steps", "5"])
    assert parse_config(["--loss-denominator", "1e3"]).denominator == 1000.0
    assert build_parser().parse_args(["--no-scale-adv-by-std"]).scale_adv_by_std is False


# ------------------------------------------------------------------ rollouts


def test_response_mask_runs_through_the_first_eos_not_up_to_pad():
    PAD, EOS, a = 0, 2, 5
    responses = torch.tensor([
        [a, a, EOS, PAD, PAD],  # ordinary: 3 tokens
        [a, PAD, a, EOS, PAD],  # the policy sampled PAD itself: it still counts
        [EOS, PAD, PAD, PAD, PAD],  # an immediate EOS: 1 token
        [a, a, a, a, a],  # no EOS: truncated, every token counts
        [a, EOS, a, EOS, PAD],  # only the first EOS ends the response
    ])
    assert response_mask(responses, EOS).sum(-1).tolist() == [3, 4, 1, 5, 2]
    assert response_mask(responses, EOS)[1].tolist() == [True, True, True, True, False]


def small_model(seed=0):
    task = RepeatTask()
    torch.manual_seed(seed)
    return task, TinyGPT(GPTConfig(task.vocab_size, task.block_size))


def test_rollouts_depend_on_seed_and_step_only_and_two_ranks_slices_rebuild_them():
    task, model = small_model()
    kwargs = dict(num_prompts=6, group_size=4, seed=7, temperature=1.0)
    one = generate_rollout(TinyGPTPolicy(model), task, step=3, **kwargs)
    again = generate_rollout(TinyGPTPolicy(model), task, step=3, **kwargs)
    assert torch.equal(one.tokens, again.tokens) and one.digest() == again.digest()
    assert not torch.equal(generate_rollout(TinyGPTPolicy(model), task, step=4, **kwargs).tokens, one.tokens)
    assert one.lengths.max() == one.tokens.shape[1] - task.prompt_len  # cut to the longest response
    assert (one.group_ids == torch.arange(24) // 4).all()
    assert torch.allclose(one.advantages.reshape(6, 4).mean(1), torch.zeros(6), atol=1e-6)
    # W = 2: each rank generates the same global batch and keeps its plan's slice; the slices
    # put back together are the W = 1 batch, for every sharding.
    for shard in ("interleave", "contiguous", "length", "balanced"):
        plan = make_plan(shard, one.lengths, 2, 2)
        rebuilt = torch.empty_like(one.tokens)
        for rank in range(2):
            rank_rollout = generate_rollout(TinyGPTPolicy(model), task, step=3, **kwargs)  # what rank `rank` samples
            idx = torch.cat(plan[rank])
            rebuilt[idx] = rank_rollout.tokens[idx]
        assert torch.equal(rebuilt, one.tokens), shard


def test_minibatch_groups_are_renumbered_from_zero():
    task, model = small_model()
    rollout = generate_rollout(TinyGPTPolicy(model), task, num_prompts=4, group_size=2, seed=0, step=1, temperature=1.0)
    second = rollout.groups(2, 2)
    assert second.group_ids.tolist() == [0, 0, 1, 1] and second.num_groups == 2
    assert torch.equal(second.tokens, rollout.tokens[4:])


def test_seeded_generators_do_not_collide_on_shifted_keys():
    draw = lambda *keys: torch.rand(4, generator=seeded_generator(*keys))  # noqa: E731
    assert torch.equal(draw(1, "rollout", 2), draw(1, "rollout", 2))
    assert not torch.equal(draw(1, "rollout", 2), draw(2, "rollout", 1))


# ------------------------------------------------------------------ checkpoints


def test_checkpoint_round_trip_restores_weights_optimizer_rng_and_counters(tmp_path):
    _, model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    opt.step()
    run = {"step": 7, "warmup": {"steps": 3, "reward_before": 0.1}}
    torch.manual_seed(123)
    path = store.save(tmp_path, 7, dist_state.training_state(model, opt), run, rank=0)
    expected_draw = torch.rand(3)  # the first draw after the RNG state the checkpoint holds
    store.save(tmp_path, 12, dist_state.training_state(model, opt), {**run, "step": 12}, rank=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_step12", "ckpt_step7"]  # no temporary directory
    assert store.latest_checkpoint(tmp_path).name == "ckpt_step12"  # 12 > 7 numerically
    assert store.read_run_state(path, required=("step", "warmup")) == run  # plain JSON

    _, fresh = small_model(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = dist_state.training_state(fresh, fresh_opt)
    torch.manual_seed(999)
    store.load(path, state, rank=0)
    assert torch.equal(torch.rand(3), expected_draw)
    dist_state.apply_training_state(fresh, fresh_opt, None, state)
    for name, p in model.state_dict().items():
        assert torch.equal(p, fresh.state_dict()[name]), name
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert float(fresh_opt.state_dict()["state"][0]["step"]) == 1


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_temporary_directory(tmp_path, monkeypatch):
    _, model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store.save(tmp_path, 1, dist_state.training_state(model, opt), {"step": 1}, rank=0)

    def full_disk(state, directory):
        (directory / "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dist_state, "write", full_disk)
    with pytest.raises(store.CheckpointError, match=r"No space left on device.*the previous checkpoint \S+ckpt_step1 is intact"):
        store.save(tmp_path, 2, dist_state.training_state(model, opt), {"step": 2}, rank=0)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt_step1"]
    assert store.read_run_state(store.latest_checkpoint(tmp_path), required=("step",))["step"] == 1
    assert store.latest_checkpoint(tmp_path / "missing") is None


# ------------------------------------------------------------------ the learning curve


def test_learning_curve_is_drawn_from_metrics(tmp_path):
    rows = [{"step": s, "reward_mean": r} for s, r in enumerate([0.2, 0.4, 0.6, 0.8], start=1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "warmup.json").write_text(json.dumps({"steps": 5, "reward_before": 0.0, "reward_after": 0.2}))
    assert moving_average([0.2, 0.4, 0.6, 0.8], 2) == pytest.approx([0.2, 0.3, 0.5, 0.7])
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    plot_learning_curve(ax, rows, window=2)
    assert list(ax.lines[0].get_ydata()) == [0.2, 0.4, 0.6, 0.8]
    assert list(ax.lines[1].get_ydata()) == pytest.approx([0.2, 0.3, 0.5, 0.7])
    path = write_learning_curve(tmp_path)
    assert path.exists() and path.read_bytes()[:4] == b"\x89PNG"
