"""A Hugging Face run's prompt length, checked before its weights load: the model's context and memory.

The prompt length P of a Hugging Face run is the longest prompt of --prompts in tokens, known once
the tokenizer has run (the preflight, before it, takes P = 1). ``build_policy`` checks two things
with it between the tokenizer and the weights:

- P + --max-new-tokens within the context the model's config states (``max_position_embeddings``,
  or the field a config class maps it to, GPT-2's ``n_positions``): one error line, exit 2. The
  control: P + R equal to the context passes. A config that states no context passes.
- the memory estimate at P: its rollout part equals the bytes of the real KV cache at P + R and the
  prefill logits of the P prompt positions, and a run that fits at P = 1 but not at P is refused.
  The control: one byte more free memory passes.

Each main() run uses a copy of the tiny model whose weights file is garbage that only loading
reads: a refusal that comes instead of the loader's error came before the weights load, and a
control that gets the loader's error passed the check. Everything runs in-process (no torchrun).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import build_tiny_llama  # noqa: E402  (examples/, on the path via conftest)

from gradnorm.models import hf  # noqa: E402
from gradnorm.tasks.prompts import PromptTask  # noqa: E402
from gradnorm.train import main  # noqa: E402
from gradnorm.trainer.config import parse_config  # noqa: E402
from gradnorm.trainer.guards import (
    failures,  # noqa: E402
    memory,
    preflight,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = str(ROOT / "examples" / "arithmetic.jsonl")
R = 8  # --max-new-tokens


def flags(model: Path, out: Path) -> list[str]:
    return ["--model", str(model), "--prompts", PROMPTS, "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", str(R), "--eval-prompts", "2", "--steps", "1", "--no-plot", "--export-hf", "none",
            "--output-dir", str(out)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the tiny Llama, a copy whose weights are garbage, P: the longest example prompt in its tokens)."""
    base = tmp_path_factory.mktemp("hf_prompt_length")
    real = build_tiny_llama(base / "tiny-llama", seed=0)
    garbage = base / "garbage-weights"
    shutil.copytree(real, garbage, ignore=shutil.ignore_patterns("*.safetensors"))
    (garbage / "pytorch_model.bin").write_bytes(b"not a checkpoint")  # readable: the preflight lets it pass
    P = PromptTask.from_file(PROMPTS, hf.load_tokenizer(str(real)), max_new_tokens=R).prompt_len
    return real, garbage, P


def set_context(model: Path, positions: int) -> None:
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (model / "config.json").write_text(json.dumps(config))


def error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error: ")]


def test_a_sequence_longer_than_the_models_context_is_one_line_before_the_weights_load(models, tmp_path, capsys):
    """Before, nothing compared them: GPT-2 raised an IndexError as it sampled, this Llama trained past its context."""
    _, garbage, P = models
    set_context(garbage, P + R - 1)
    assert main(flags(garbage, tmp_path / "a")) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1, errors
    assert (f"a sequence reaches {P + R} tokens (the longest prompt of {PROMPTS}, {P} tokens, + --max-new-tokens "
            f"{R}), more than --model {garbage} takes ({P + R - 1}, max_position_embeddings in its config); "
            f"lower --max-new-tokens to {R - 1} or less") in errors[0], errors
    # The control: P + R equal to the context passes the check, and the garbage weights are next.
    set_context(garbage, P + R)
    assert main(flags(garbage, tmp_path / "b")) == 1
    errors = error_lines(capsys)
    assert len(errors) == 1 and f"--model '{garbage}'" in errors[0] and "tokens" not in errors[0], errors


def test_a_prompt_longer_than_the_context_alone_says_so_and_a_config_without_one_passes(models, tmp_path):
    real, _, P = models
    short = tmp_path / "short"
    shutil.copytree(real, short)
    set_context(short, P - 1)
    cfg = parse_config(flags(short, tmp_path / "out"))
    with pytest.raises(failures.InputError, match="the prompt alone leaves no room for a response"):
        preflight.check_context(cfg, P)
    import transformers

    transformers.GPT2Config(n_positions=P + R - 1).save_pretrained(tmp_path / "gpt2")  # its context is n_positions
    assert hf.context_length(str(tmp_path / "gpt2")) == ("n_positions", P + R - 1)
    transformers.BloomConfig().save_pretrained(tmp_path / "bloom")  # ALiBi: no position table, no stated context
    assert hf.context_length(str(tmp_path / "bloom")) is None
    preflight.check_context(parse_config(flags(tmp_path / "bloom", tmp_path / "out")), 10**6)


def kv_cache_bytes(cache) -> int:
    """The bytes of a transformers cache's keys and values (``layers`` in transformers 5, lists before)."""
    if hasattr(cache, "layers"):
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    else:
        tensors = [*cache.key_cache, *cache.value_cache]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_estimate_takes_the_longest_prompt_and_equals_the_real_kv_cache_and_prefill_logits(models, tmp_path):
    real, _, P = models
    cfg = parse_config(flags(real, tmp_path / "out"))
    assert cfg.updates_per_rollout == 1 and cfg.beta == 0  # nothing rescored: the rollout part is cache + prefill
    task = PromptTask.from_file(PROMPTS, hf.load_tokenizer(str(real)), max_new_tokens=R)
    model = hf.load_causal_lm(str(real), task.tokenizer.pad_id).eval()
    S = cfg.prompts_per_step * cfg.minibatches_per_rollout * cfg.group_size
    prompts, _ = task.sample_prompts(S, torch.Generator().manual_seed(0))  # (S, P)
    with torch.no_grad():
        prefill = model(input_ids=prompts, use_cache=True).logits  # (S, P, V): what generate's first call holds
        whole = model(input_ids=torch.cat([prompts, prompts[:, -R:]], dim=1), use_cache=True)  # the cache at P + R
    real_bytes = kv_cache_bytes(whole.past_key_values) + prefill.numel() * prefill.element_size()
    shape = memory.model_shape(cfg, prompt_len=P)
    assert shape["prompt_len"] == P and memory.model_shape(cfg)["prompt_len"] == 1  # the preflight's P = 1
    assert memory.estimate(cfg, shape, 1, "cpu")["rollout"] == real_bytes
    parts = [memory.estimate(cfg, memory.model_shape(cfg, prompt_len=p), 1, "cpu") for p in (1, P // 2, P)]
    for name in ("rollout", "training", "eval"):
        assert parts[0][name] < parts[1][name] < parts[2][name], name  # every part that holds the prompt grows


def test_a_run_that_fits_only_at_prompt_length_1_is_refused_before_the_weights_load(models, tmp_path, capsys,
                                                                                     monkeypatch):
    """Before, the estimate took P = 1 for a Hugging Face model, so this run passed it."""
    _, garbage, P = models
    set_context(garbage, P + R)
    cfg = parse_config(flags(garbage, tmp_path / "a"))

    def need(prompt_len):
        parts = memory.estimate(cfg, memory.model_shape(cfg, prompt_len=prompt_len), 1, "cpu")
        return parts["static"] + max(v for k, v in parts.items() if k != "static")

    monkeypatch.setattr(memory, "available", lambda device: need(P) - 1)
    assert need(1) < need(P) - 1  # the preflight, at P = 1, lets it pass
    assert main(flags(garbage, tmp_path / "a")) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and f"needs at least {memory.size(need(P))} per rank on cpu" in errors[0], errors
    assert f"prompts of up to {P} tokens" in errors[0], errors
    # The control: one byte more passes the estimate, and the garbage weights are next.
    monkeypatch.setattr(memory, "available", lambda device: need(P))
    assert main(flags(garbage, tmp_path / "b")) == 1
    errors = error_lines(capsys)
    assert len(errors) == 1 and f"--model '{garbage}'" in errors[0] and "needs at least" not in errors[0], errors


def test_a_gpt2_config_is_measured_by_its_own_names_and_an_unknown_naming_is_not(tmp_path):
    """GPT-2 spells the width, depth and heads n_embd, n_layer, n_head: before, it got no estimate."""
    import transformers

    transformers.GPT2Config(n_embd=48, n_layer=3, n_head=4, vocab_size=101).save_pretrained(tmp_path / "gpt2")
    shape = memory.model_shape(parse_config(flags(tmp_path / "gpt2", tmp_path / "out")), prompt_len=7)
    assert (shape["width"], shape["n_layer"], shape["kv_width"], shape["vocab"], shape["prompt_len"]) == (48, 3, 48, 101, 7)
    (tmp_path / "odd").mkdir()  # the control: names no rule knows give no estimate rather than a wrong one
    (tmp_path / "odd" / "config.json").write_text('{"width": 48, "depth": 3, "vocab_size": 101}')
    assert memory.model_shape(parse_config(flags(tmp_path / "odd", tmp_path / "out"))) is None
