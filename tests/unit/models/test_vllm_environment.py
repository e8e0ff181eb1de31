"""VLLM_CPU_KVCACHE_SPACE is checked before vLLM starts: a value vLLM cannot use (``abc``, ``0``, ``-1``)
is one line naming the variable and a valid example. Needs no vllm: the engine's import of vllm is
replaced by a sentinel, which a valid value reaches (the control) and a bad one never does."""

import pytest

from gradnorm.models import vllm_engine


class ReachedVLLM(Exception):
    pass


@pytest.fixture
def no_vllm(monkeypatch):
    def reached():
        raise ReachedVLLM

    monkeypatch.setattr(vllm_engine, "import_vllm", reached)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5", ""])
def test_a_bad_kv_cache_size_is_one_line_naming_the_variable_before_vllm_starts(value, no_vllm, monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
    with pytest.raises(vllm_engine.EngineError) as err:
        vllm_engine.VLLMEngine(str(tmp_path / "model"), max_model_len=8)
    message = str(err.value)
    assert f"VLLM_CPU_KVCACHE_SPACE={value!r}" in message and "e.g. VLLM_CPU_KVCACHE_SPACE=4" in message
    assert "\n" not in message
    with pytest.raises(vllm_engine.EngineError):  # the trainer's preflight calls the same check
        vllm_engine.check_environment({"VLLM_CPU_KVCACHE_SPACE": value})


@pytest.mark.parametrize("value", ["4", " 2 ", None])
def test_control_a_valid_or_unset_size_reaches_vllm(value, no_vllm, monkeypatch, tmp_path):
    if value is None:
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the engine sets its default, 1
    else:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    with pytest.raises(ReachedVLLM):
        vllm_engine.VLLMEngine(str(tmp_path / "model"), max_model_len=8)
    vllm_engine.check_environment({} if value is None else {"VLLM_CPU_KVCACHE_SPACE": value})
