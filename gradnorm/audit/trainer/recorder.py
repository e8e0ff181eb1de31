"""What runs inside each trainer process: record the probe's inputs, read its gradient at the first step.

``install()`` registers two global hooks, so that neither the trainer nor the model need know:

- a module forward hook that, for the probe's embedding (an ``nn.Embedding`` of shape (V, V))
  called with gradients enabled, keeps the input ids, and a tensor hook on its output that marks
  the forward when a gradient reaches it: only forwards that took part in a backward are saved
  (generation and reference forwards run without gradients; a forward with gradients whose output
  no loss used is dropped), each with the backward it took part in (``microbatches``: forwards
  whose gradients arrive together, with no forward between them, are one microbatch, however many
  forward calls a trainer splits it into, e.g. gradnorm's chunks of rows by length);
- an optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``) that, at
  the first optimizer step of the process, saves the head's gradient as the optimizer is about to
  take it (after DDP's all-reduce, accumulation and any clipping) with the recorded inputs, to
  ``$GRADNORM_PROBE_OUT/rank<R>.pt``. Later steps are not read. The head is the optimizer's one
  (V, V) parameter that is not the embedding: a trainer may apply it without calling its module
  (TRL's fused LM-head loss reads ``get_output_embeddings().weight``), so no forward hook sees it.

- wrappers of ``torch.nn.utils.clip_grad_norm_`` and ``clip_grads_with_norm_`` (accelerate's and
  the Trainer's path) that keep the first step's clipping factor
  (max_norm / total_norm when the norm exceeds max_norm): a generating probe's head is not zero,
  so its embedding and norm get gradient too, and a trainer's clip at max_grad_norm = 1 would
  scale every weight by a factor the audit itself caused. The readout divides it out and says so.

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
    _state.update(out=Path(out), vocab=int(vocab), forwards=[], backward_of=[], backwards=0, last="forward",
                  embedding=None, done=False,
                  rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1")))
    nn.modules.module.register_module_forward_hook(_on_forward)
    register_optimizer_step_pre_hook(_on_step)
    _state["clip"] = 1.0
    utils = torch.nn.utils
    clip, clip_with = utils.clip_grad_norm_, utils.clip_grads_with_norm_

    def keep(max_norm, total_norm) -> None:
        if not _state["done"]:  # the factor both functions multiply every gradient by
            _state["clip"] = min(1.0, float(max_norm) / (float(total_norm) + 1e-6))

    def recorded_clip(parameters, max_norm, *args, **kwargs):
        total = clip(parameters, max_norm, *args, **kwargs)
        keep(max_norm, total)
        return total

    def recorded_clip_with(parameters, max_norm, total_norm, *args, **kwargs):
        keep(max_norm, total_norm)
        return clip_with(parameters, max_norm, total_norm, *args, **kwargs)

    utils.clip_grad_norm_, utils.clip_grads_with_norm_ = recorded_clip, recorded_clip_with
    return True


def _on_forward(module: nn.Module, args: tuple, output) -> None:
    if _state["done"] or not torch.is_grad_enabled():
        return
    V = _state["vocab"]
    if isinstance(module, nn.Embedding) and tuple(module.weight.shape) == (V, V) and args:
        index = len(_state["forwards"])
        _state["forwards"].append(args[0].detach().to("cpu", copy=True))
        _state["backward_of"].append(None)
        _state["embedding"] = module.weight
        _state["last"] = "forward"
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad, index=index: _on_gradient(index))
        else:  # a frozen embedding: no tensor here sees the backward, so the forward is kept as its own microbatch
            _state["backward_of"][index] = -1 - index


def _on_gradient(index: int) -> None:
    """The gradient of forward ``index``'s output arrived: it took part in the backward under way."""
    if _state["last"] == "forward":  # the first gradient since a forward: a new backward (a new microbatch)
        _state["backwards"] += 1
        _state["last"] = "backward"
    _state["backward_of"][index] = _state["backwards"]


def _used_forwards() -> tuple[list, list[int]]:
    """The forwards that took part in a backward, and the index of the microbatch (backward) each belongs to."""
    kept = [(x, b) for x, b in zip(_state["forwards"], _state["backward_of"]) if b is not None]
    order = {b: m for m, b in enumerate(dict.fromkeys(b for _, b in kept))}
    return [x for x, _ in kept], [order[b] for _, b in kept]


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
    forwards, microbatches = _used_forwards()
    torch.save({"rank": _state["rank"], "world_size": _state["world_size"], "forwards": forwards,
                "microbatches": microbatches, "grad": grad, "clip": _state["clip"]}, tmp)
    tmp.replace(out / f"rank{_state['rank']}.pt")  # whole or absent: the audit never reads half a file
