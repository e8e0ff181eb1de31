"""Reading training runs (``gradnorm.teach.runs``) back from files a run writes; no trainer is launched."""

import json

import numpy as np
from numpy.testing import assert_allclose

from gradnorm.teach import runs


def fake_run(tmp_path, name, denominator, shard, digests, grad_norms, tokens_per_rank):
    out = tmp_path / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"loss_denominator": denominator, "shard": shard,
                                                  "max_grad_norm": 1.5}))
    rows = [{"step": k + 1, "grad_norm": g, "reward_mean": 0.5, "response_len_mean": 9.0, "rollout_digest": d,
             "tokens": sum(t), "tokens_per_rank": t}
            for k, (d, g, t) in enumerate(zip(digests, grad_norms, tokens_per_rank))]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return runs.load_run(out)


def test_load_run_reads_its_config_and_series(tmp_path):
    a = fake_run(tmp_path, "a", "local", "length", ["x", "y", "z"], [1.0, 2.0, 3.0], [[1, 3], [2, 2], [0, 4]])
    b = fake_run(tmp_path, "b", "token", "balanced", ["x", "y", "w"], [1.0, 1.0, 1.0], [[2, 2]] * 3)
    assert a.label == "local, length" and b.loss_denominator == "token" and b.shard == "balanced"
    assert_allclose(a.steps, [1, 2, 3])
    assert_allclose(a.series("grad_norm"), [1.0, 2.0, 3.0])
    assert a.config["max_grad_norm"] == 1.5


def test_moving_average_is_trailing():
    assert_allclose(runs.moving_average(np.array([1.0, 2.0, 3.0, 4.0, 5.0]), 2), [1.0, 1.5, 2.5, 3.5, 4.5])
    assert_allclose(runs.moving_average(np.array([2.0, 4.0]), 10), [2.0, 3.0])


def test_read_metrics_reads_one_row_per_line_and_skips_blank_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n')
    assert runs.read_metrics(path) == [{"step": 1}, {"step": 2}]
