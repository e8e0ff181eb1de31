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
    peak     = static + max(rollout, training)

with b = 2 bytes under bf16 autocast, else 4. A Hugging Face model's prompt length P is taken as
1 before its tokenizer has run, and a Hub id's shape is unknown before it downloads: no estimate.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from gradnorm.trainer.preflight import is_local_model, safetensors_params
from gradnorm.tasks import RepeatTask
from gradnorm.models.tinygpt import GPTConfig, TinyGPT
from gradnorm.trainer.trainconfig import TrainConfig

GiB = 2**30


def model_shape(cfg: TrainConfig) -> dict | None:
    """{params, n_layer, width, kv_width, vocab, prompt_len} of the policy, or None when unknown."""
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
    width, layers, vocab = (config.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    heads = config.get("num_attention_heads")
    if not all(isinstance(v, int) and v > 0 for v in (width, layers, vocab, heads)):
        return None
    head_dim = config.get("head_dim") or width // heads
    return {"params": sum(safetensors_params(f) for f in path.glob("*.safetensors")), "n_layer": layers,
            "width": width, "kv_width": (config.get("num_key_value_heads") or heads) * head_dim, "vocab": vocab,
            "prompt_len": 1}


def estimate(cfg: TrainConfig, shape: dict, world_size: int, device_type: str) -> dict[str, int]:
    """Bytes per rank of the three parts of the module docstring: static, rollout, training."""
    b = 2 if cfg.autocast_dtype(device_type) is not None else 4
    N, L, d, d_kv, V, P = (shape[k] for k in ("params", "n_layer", "width", "kv_width", "vocab", "prompt_len"))
    R = cfg.max_new_tokens
    S_roll = cfg.prompts_per_step * cfg.minibatches_per_rollout * cfg.group_size
    mb = math.ceil(cfg.sequences_per_step / (world_size * cfg.grad_accum_steps))
    rescored = cfg.updates_per_rollout > 1 or cfg.beta > 0
    return {
        "static": 16 * N // (world_size if cfg.parallel == "fsdp" else 1) + (4 * N if cfg.beta > 0 else 0),
        "rollout": 2 * L * S_roll * (P + R) * d_kv * b + S_roll * P * V * b + (S_roll * R * V * (b + 4) if rescored else 0),
        "training": mb * R * V * (b + 8) + L * mb * (P + R) * d * b * (1 if cfg.gradient_checkpointing else 4),
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
}


def check_fits(cfg: TrainConfig, world_size: int, device: torch.device, sharing: int = 1) -> None:
    """A one-line ValueError when the estimate exceeds the free memory; ``sharing`` ranks share a host's RAM."""
    shape = model_shape(cfg)
    if shape is None:
        return
    parts = estimate(cfg, shape, world_size, device.type)
    need = parts["static"] + max(parts["rollout"], parts["training"])
    free = available(device) // (sharing if device.type == "cpu" else 1)
    if need <= free:
        return
    worst = max(parts, key=parts.get)
    raise ValueError(f"this configuration needs at least {size(need)} per rank on {device} ({worst} "
                     f"{size(parts[worst])}: --prompts-per-step {cfg.prompts_per_step} x --group-size "
                     f"{cfg.group_size}, --max-new-tokens {cfg.max_new_tokens}), but {size(free)} are free; "
                     f"{ADVICE[worst]}")


def size(n: int) -> str:
    """Bytes in the largest binary unit that leaves a number >= 1: 1.5 GiB, 12.0 KiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def local_ranks(environ=os.environ) -> int:
    """Processes of this job on this host (torchrun's LOCAL_WORLD_SIZE), which share its RAM."""
    return int(environ.get("LOCAL_WORLD_SIZE", "1")) if environ.get("LOCAL_WORLD_SIZE", "1").isdigit() else 1
