"""The trainer on a Hugging Face model, offline: a tiny random Llama, real torchrun launches over gloo.

The model and its character-level tokenizer are built locally (``build_tiny_llama``, no download)
and loaded with ``--model <dir>``; prompts come from ``examples/arithmetic.jsonl`` through the
tokenizer's chat template. The reward is plugged in as ``module:function``: an arbitrary but
deterministic score of the response text, so that a random model's groups get nonzero
advantages (exact match would almost always be 0 and leave nothing to normalize).

What must hold after 2 steps, responses sorted by length over ranks (``--shard length``):
- step 1's rollout is bit-identical for (W, A) = (1, 2) and (2, 1), under DDP and FSDP2;
- under ``token`` its gradient norm is the same for (1, 2) and (2, 1), under DDP and under FSDP2;
- the control: under ``local`` it differs from token's (ranks hold ragged token counts), and
  FSDP2 gives the same local value as DDP, so the comparison could fail and FSDP2 is the same
  reduction as DDP.
"""

import os
import sys
from pathlib import Path

import pytest
from torch.testing import assert_close

pytest.importorskip("transformers")

from tiny_models import build_tiny_llama  # noqa: E402
from gradnorm.teach.launch import torchrun_command
from tests.helpers.runfiles import launch_all, metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
REWARD_MODULE = '''
def text_score(response, answer):
    """Deterministic and arbitrary: spreads rewards over [0, 1] so every group has an advantage."""
    return (sum(map(ord, response)) % 11) / 10
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(mode, W, A, parallel): metrics of 2 steps}."""
    base = tmp_path_factory.mktemp("train_hf")
    model = build_tiny_llama(base / "tiny-llama", seed=0)
    (base / "hf_test_rewards.py").write_text(REWARD_MODULE)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(base), os.environ.get("PYTHONPATH")]))}
    flags = ["--model", str(model), "--prompts", "examples/arithmetic.jsonl", "--reward", "hf_test_rewards:text_score",
             "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "24", "--eval-prompts", "2",
             "--steps", "2", "--shard", "length", "--seed", "1", "--no-plot"]
    jobs, outs = [], {}
    for mode, world_size, accum, parallel in [("token", 1, 2, "ddp"), ("token", 2, 1, "ddp"), ("local", 2, 1, "ddp"),
                                              ("token", 2, 1, "fsdp"), ("local", 2, 1, "fsdp")]:
        out = outs[mode, world_size, accum, parallel] = base / f"{mode}-{world_size}-{accum}-{parallel}"
        args = [*flags, "--loss-denominator", mode, "--grad-accum-steps", str(accum),
                "--parallel", parallel, "--output-dir", str(out)]
        jobs.append([sys.executable, "gradnorm/train.py", *args] if world_size == 1 else torchrun_command(world_size, *args))
    launch_all(jobs, ROOT, env)  # two at a time: each writes its own directory
    found = {key: metrics(out) for key, out in outs.items()}
    return found


def test_two_steps_ran_with_the_same_step_one_rollout_everywhere(runs):
    assert all(len(rows) == 2 for rows in runs.values())
    assert len({rows[0]["rollout_digest"] for rows in runs.values()}) == 1
    first = runs["token", 1, 2, "ddp"][0]
    assert first["tokens_per_rank"] == [first["tokens"]] and first["tokens"] > 0  # W = 1: one rank holds them all
    sharded = runs["token", 2, 1, "ddp"][0]
    ragged = sharded["tokens_per_rank"]
    assert sum(ragged) == sharded["tokens"] == first["tokens"]  # the same rollout, split over 2 ranks
    assert ragged[0] < ragged[1], ragged  # sorted by length: rank 0 holds the short responses


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_token_grad_norm_is_the_same_for_w1_a2_and_w2_a1(runs, parallel):
    reference = runs["token", 1, 2, "ddp"][0]["grad_norm"]
    assert reference > 0
    assert_close(runs["token", 2, 1, parallel][0]["grad_norm"], reference, rtol=1e-5, atol=0)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_local_grad_norm_differs_under_length_sharding(runs, parallel):
    token = runs["token", 1, 2, "ddp"][0]["grad_norm"]
    local = runs["local", 2, 1, parallel][0]["grad_norm"]
    assert abs(local - token) / token > 1e-2, (local, token)
    assert_close(local, runs["local", 2, 1, "ddp"][0]["grad_norm"], rtol=1e-5, atol=0)  # FSDP2 reduces like DDP
