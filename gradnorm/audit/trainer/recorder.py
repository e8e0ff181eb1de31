"""What runs inside each trainer process: record the probe's inputs, read its gradient at the first step.

``install()`` registers two global hooks, so that neither the trainer nor the model need know:

- a module forward pre-hook that, for the probe's embedding (an ``nn.Embedding`` of shape (V, V))
  called with gradients enabled, keeps the input ids: each call is one microbatch's forward on
  this rank (generation and reference forwards run without gradients and are not kept);
- an optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``) that, at
  the first optimizer step of the process, saves the head's gradient as the optimizer is about to
  take it (after DDP's all-reduce, accumulation and any clipping) with the recorded inputs, to
  ``$GRADNORM_PROBE_OUT/rank<R>.pt``. Later steps are not read. The head is the optimizer's one
  (V, V) parameter that is not the embedding: a trainer may apply it without calling its module
  (TRL's fused LM-head loss reads ``get_output_embeddings().weight``), so no forward hook sees it.

The environment says what to do: ``GRADNORM_PROBE_OUT`` (where to write) and
``GRADNORM_PROBE_VOCAB`` (V). ``gradnorm/audit/trainer/site/sitecustomize.py`` calls ``install()`` in
every Python process of a command run by ``python -m gradnorm.audit --script``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

_state: dict = {}


def install() -> bool:
    """Register the hooks if the environment asks for them (once per process); True if it did."""
    out, vocab = os.environ.get("GRADNORM_PROBE_OUT"), os.environ.get("GRADNORM_PROBE_VOCAB")
    if not out or not vocab or _state:
        return False
    _state.update(out=Path(out), vocab=int(vocab), forwards=[], embedding=None, done=False,
                  rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1")))
    nn.modules.module.register_module_forward_pre_hook(_on_forward)
    register_optimizer_step_pre_hook(_on_step)
    return True


def _on_forward(module: nn.Module, args: tuple) -> None:
    if _state["done"] or not torch.is_grad_enabled():
        return
    V = _state["vocab"]
    if isinstance(module, nn.Embedding) and tuple(module.weight.shape) == (V, V) and args:
        _state["forwards"].append(args[0].detach().to("cpu", copy=True))
        _state["embedding"] = module.weight


def _on_step(optimizer, args, kwargs) -> None:
    if _state["done"]:
        return
    _state["done"] = True
    V, embedding = _state["vocab"], _state["embedding"]
    heads = [p for group in optimizer.param_groups for p in group["params"]
             if tuple(p.shape) == (V, V) and p is not embedding]
    head = heads[0] if len(heads) == 1 and embedding is not None else None
    grad = None if head is None or head.grad is None else head.grad.detach().to("cpu", torch.float64, copy=True)
    out = _state["out"]
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank{_state['rank']}.pt.tmp"
    torch.save({"rank": _state["rank"], "world_size": _state["world_size"], "forwards": _state["forwards"],
                "grad": grad}, tmp)
    tmp.replace(out / f"rank{_state['rank']}.pt")  # whole or absent: the audit never reads half a file
