"""Will a configuration fit? The largest tensors of a step against the memory the device has free.

Refusing at once beats an out-of-memory error (or the kernel's OOM killer) an hour into the first
rollout. The estimate is the worst case a run must survive, every response ``max-new-tokens``
long (a policy may produce that at any step), and it counts only the largest tensors, per rank:

    static   = 16 N bytes: fp32 weights, gradients and AdamW's two moments (divided by W under
               FSDP), plus 4 N for the frozen reference when beta > 0
    rollout  = KV cache 2 L S_roll (P + R) d_kv b  +  prefill logits S_roll P V b
               (+ the whole rollout scored under no_grad, S_roll R V (b + 4) bytes, when old or
               reference log-probs are needed); every rank samples the whole rollout batch, so
               S_roll = prompts-per-step * minibatches-per-rollout * group-size, whatever W
    training = a microbatch's logits mb R V (b + 4 + 4) (logits, fp32 log-softmax, its gradient)
               + activations L mb (P + R) d b c, c = 4 tensors of width d per layer (1 with
               gradient checkpointing); mb = S / (W A)
    eval     = the rollout's KV cache and prefill logits for S_eval = --eval-prompts sequences
    warmup   = (built-in model) B (P + R) V (b + 8) + 4 L B (P + R) d b, B = --warmup-batch
    peak     = static + max(rollout, training, eval, warmup)

with b = 2 bytes under bf16 autocast, else 4. A Hub id's shape is unknown before it downloads: no
estimate.

A Hugging Face model's prompt length P, the longest prompt of --prompts in tokens, is known only once
its tokenizer has run. The preflight takes P = 1 (a lower bound: what it refuses, no prompt makes
fit); ``build_policy`` checks again with the real P, between the tokenizer and the weights
(``check_prompt_length``), together with the model's context: P + max-new-tokens must not exceed what
its config states. Tokenizing at preflight would tokenize every prompt twice, and a Hub id's
tokenizer is not there before it downloads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from gradnorm.models.tinygpt import GPTConfig, TinyGPT
from gradnorm.tasks import RepeatTask
from gradnorm.trainer.config import TrainConfig
from gradnorm.trainer.guards.failures import InputError
from gradnorm.trainer.guards.preflight import check_context, is_local_model, safetensors_params

GiB = 2**30


def model_shape(cfg: TrainConfig, prompt_len: int | None = None) -> dict | None:
    """{params, n_layer, width, kv_width, vocab, prompt_len} of the policy, or None when unknown.

    ``prompt_len``: a Hugging Face model's P, the longest prompt of --prompts in tokens; 1 when not
    given (the preflight, before the tokenizer has run).
    """
    if cfg.builtin:
        task = RepeatTask(max_new_tokens=cfg.max_new_tokens)
        with torch.device("meta"):  # shapes only, no memory
            model = TinyGPT(GPTConfig(task.vocab_size, task.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd))
        return {"params": sum(p.numel() for p in model.parameters()), "n_layer": cfg.n_layer, "width": cfg.n_embd,
                "kv_width": cfg.n_embd, "vocab": task.vocab_size, "prompt_len": task.prompt_len}
    path = Path(cfg.model).expanduser()
    if not (is_local_model(cfg.model) and (path / "config.json").is_file()):
        return None
    config = json.loads((path / "config.json").read_text())
    config = config.get("text_config", config)  # a multimodal model's language model
    # the names most configs use, then GPT-2's (n_embd, n_layer, n_head) and T5-style ones
    width, layers, heads = (next((config[k] for k in names if config.get(k)), None) for names in (
        ("hidden_size", "n_embd", "d_model"), ("num_hidden_layers", "n_layer", "num_layers"),
        ("num_attention_heads", "n_head", "num_heads")))
    vocab = config.get("vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (width, layers, vocab, heads)):
        return None
    head_dim = config.get("head_dim") or width // heads
    return {"params": sum(safetensors_params(f) for f in path.glob("*.safetensors")), "n_layer": layers,
            "width": width, "kv_width": (config.get("num_key_value_heads") or heads) * head_dim, "vocab": vocab,
            "prompt_len": 1 if prompt_len is None else prompt_len}


def estimate(cfg: TrainConfig, shape: dict, world_size: int, device_type: str) -> dict[str, int]:
    """Bytes per rank of the three parts of the module docstring: static, rollout, training."""
    b = 2 if cfg.autocast_dtype(device_type) is not None else 4
    N, L, d, d_kv, V, P = (shape[k] for k in ("params", "n_layer", "width", "kv_width", "vocab", "prompt_len"))
    R = cfg.max_new_tokens
    S_roll = cfg.prompts_per_step * cfg.minibatches_per_rollout * cfg.group_size
    mb = math.ceil(cfg.sequences_per_step / (world_size * cfg.grad_accum_steps))
    rescored = cfg.updates_per_rollout > 1 or cfg.beta > 0
    S_eval, B_warm, T = cfg.eval_prompts, cfg.warmup_batch if cfg.builtin else 0, P + R
    return {
        "static": 16 * N // (world_size if cfg.parallel == "fsdp" else 1) + (4 * N if cfg.beta > 0 else 0),
        "rollout": 2 * L * S_roll * (P + R) * d_kv * b + S_roll * P * V * b + (S_roll * R * V * (b + 4) if rescored else 0),
        "training": mb * R * V * (b + 8) + L * mb * (P + R) * d * b * (1 if cfg.gradient_checkpointing else 4),
        # the reward before and after the warm-up: one response for each of --eval-prompts, on every rank
        "eval": 2 * L * S_eval * T * d_kv * b + S_eval * P * V * b,
        # the built-in model's supervised warm-up: whole sequences, logits with their log-softmax and gradient
        "warmup": B_warm * T * V * (b + 8) + 4 * L * B_warm * T * d * b,
    }


def available(device: torch.device) -> int:
    """Bytes free on ``device``: CUDA's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024


ADVICE = {
    "static": "the weights, gradients and AdamW state alone need that: --parallel fsdp over more GPUs, or a smaller --model",
    "rollout": "every rank samples the whole rollout batch: lower --prompts-per-step, --group-size, "
               "--minibatches-per-rollout or --max-new-tokens",
    "training": "raise --grad-accum-steps or the number of ranks, lower --max-new-tokens, or (a Hugging Face "
                "model) add --gradient-checkpointing",
    "eval": "every rank samples one response per evaluation prompt: lower --eval-prompts or --max-new-tokens",
    "warmup": "the warm-up trains on whole sequences in one batch: lower --warmup-batch",
}


WHAT = {"eval": "--eval-prompts {cfg.eval_prompts}", "warmup": "--warmup-batch {cfg.warmup_batch}"}
"""The flags behind a part of the estimate, for its error line (the rest: the batch of a step)."""


def check_fits(cfg: TrainConfig, world_size: int, device: torch.device, sharing: int = 1,
               prompt_len: int | None = None) -> None:
    """A one-line ValueError when the estimate exceeds the free memory; ``sharing`` ranks share a host's RAM.

    ``prompt_len``: a Hugging Face model's longest prompt in tokens, once known (``model_shape``).
    """
    shape = model_shape(cfg, prompt_len)
    if shape is None:
        return
    parts = estimate(cfg, shape, world_size, device.type)
    need = parts["static"] + max(v for k, v in parts.items() if k != "static")
    free = available(device) // (sharing if device.type == "cpu" else 1)
    if need <= free:
        return
    worst = max(parts, key=parts.get)
    if worst == "static":  # the model's size alone: its flags, not the batch's
        params = f"{shape['params'] / 1e9:.3g}B parameters" if shape["params"] >= 1e8 else f"{shape['params']:,} parameters"
        if cfg.builtin:
            flags = f"--n-layer {cfg.n_layer} x --n-embd {cfg.n_embd}, {params}"
            advice = ("the weights, gradients and AdamW state alone need that: lower --n-embd or --n-layer, or "
                      "--parallel fsdp over more ranks")
        else:
            flags, advice = f"--model {cfg.model}, {params}", ADVICE["static"]
    else:
        flags = WHAT.get(worst, "--prompts-per-step {cfg.prompts_per_step} x --group-size {cfg.group_size}").format(cfg=cfg)
        if prompt_len is not None:
            flags += f", prompts of up to {prompt_len} tokens"
        flags, advice = f"{flags}, --max-new-tokens {cfg.max_new_tokens}", ADVICE[worst]
    raise ValueError(f"this configuration needs at least {size(need)} per rank on {device} ({worst} "
                     f"{size(parts[worst])}: {flags}), but {size(free)} are free; {advice}")


def check_prompt_length(cfg: TrainConfig, prompt_len: int, world_size: int, device: torch.device,
                        sharing: int = 1) -> None:
    """What a Hugging Face run's longest prompt must pass once its tokenizer has run, before its weights
    load: the model's context (``check_context``), then the memory estimate at that prompt length.

    ``prompt_len``: the longest prompt of --prompts in tokens (``PromptTask.prompt_len``). Each failure
    is an ``InputError``, exit code 2 like the preflight's.
    """
    check_context(cfg, prompt_len)
    try:
        check_fits(cfg, world_size, device, sharing, prompt_len)
    except ValueError as err:
        raise InputError(str(err)) from None


def size(n: int) -> str:
    """Bytes in the largest binary unit that leaves a number >= 1: 1.5 GiB, 12.0 KiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
