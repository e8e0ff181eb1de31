"""Wrap a policy for data parallelism: DDP, or FSDP2 (``fully_shard``) when it outgrows one GPU.

Part of the thin distributed shell, next to ``gradnorm.dist.comm``: nothing here issues a
collective of its own; the wrappers do (DDP's all-reduce, FSDP's all-gather and reduce-scatter).

Why the normalization needs nothing new under FSDP. Both wrappers reduce gradients by a MEAN over
the W ranks: DDP all-reduces and divides by W; FSDP2 reduce-scatters with a divide factor of W
(pinned here with ``set_gradient_divide_factor`` where torch has it, so a change of default
cannot silently turn the mean into a sum). Each rank therefore scales its token weights by W
(``denominators.rank_weights(w, W, "mean")``) under either wrapper, and after the reduction the
shard of the gradient on rank r is exactly rank r's slice of dJ/dtheta:

    DDP:   grad         = (1/W) sum_r dL_r/dtheta            (every rank holds all of it)
    FSDP2: grad[shard r] = ((1/W) sum_r dL_r/dtheta)[shard r] (every rank holds its shard)

Accumulation: DDP skips communication inside ``no_sync()``; FSDP2 has a switch,
``set_requires_gradient_sync(False)``, instead of a context. ``gradnorm.core.accumulate``'s ``_no_sync`` handles both, so
A microbatches really add up before the one reduction of the last backward.

Parameters and gradients of an FSDP2 module are DTensors (sharded over dim 0):
``full_tensor`` gathers one (a collective: every rank must call it). Checkpoint state, named and
sharded the same way under every wrapper, is ``gradnorm.dist.state``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, get_args

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from gradnorm.dist.comm import DistContext

ParallelKind = Literal["ddp", "fsdp"]
PARALLEL_KINDS: tuple[str, ...] = get_args(ParallelKind)


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # public since torch 2.6
    except ImportError:
        raise ImportError(f"--parallel fsdp needs torch >= 2.6 (FSDP2's fully_shard); this is torch {torch.__version__}") from None
    return fully_shard


def wrap_fsdp(model: nn.Module, blocks: list[nn.Module]) -> nn.Module:
    """Apply FSDP2 to each block, then to the root (embeddings, final norm, head); in place.

    Sharding block by block means only one block's full parameters exist at a time in the
    forward and backward. Parameters stay in their dtype (fp32 master weights: gradients are
    reduced in fp32; bf16 compute comes from autocast). Returns ``model``, now an FSDPModule.
    """
    fully_shard = _fully_shard()
    world_size = torch.distributed.get_world_size()
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            # ALGO LOGIC: pin the reduction to a mean over W, which rank_weights(..., "mean") undoes.
            module.set_gradient_divide_factor(float(world_size))
    return model


def wrap_policy(model: nn.Module, parallel: ParallelKind, ctx: DistContext,
                blocks: list[nn.Module] = ()) -> nn.Module:
    """The module the training forward goes through: DDP, FSDP2, or the model itself alone.

    Without a process group (plain ``python``) there is nothing to reduce, and the model is used
    as is. Under DDP, ``unwrap`` returns the inner module for sampling and checkpoints; FSDP2
    changes the model in place, so generation must go through the sharded module itself.
    ``blocks`` are the repeated blocks FSDP2 shards one by one (``Policy.blocks``); with none the
    model is one unit.
    """
    if parallel not in PARALLEL_KINDS:
        raise ValueError(f"--parallel {parallel!r}: expected one of {', '.join(PARALLEL_KINDS)}")
    if ctx.backend is None:
        return model
    if parallel == "fsdp":
        return wrap_fsdp(model, list(blocks))
    return DistributedDataParallel(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)


def unwrap(model: nn.Module) -> nn.Module:
    """The policy itself: DDP's inner module; an FSDP2 or plain module as is."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_fsdp(model: nn.Module) -> bool:
    return hasattr(model, "set_requires_gradient_sync") and hasattr(model, "reshard")


def full_tensor(t: Tensor) -> Tensor:
    """A DTensor gathered into a plain tensor (a collective); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def flat_grad(model: nn.Module) -> Tensor:
    """Every parameter's full gradient, flattened and concatenated (collective under FSDP)."""
    return torch.cat([full_tensor(p.grad).reshape(-1) for p in model.parameters()])


def clip_grad_norm(model: nn.Module, max_norm: float) -> Tensor:
    """Clip the global gradient norm in place; return the norm before clipping, a 0-d tensor.

    Under FSDP2 the gradients are shards and ``clip_grad_norm_`` returns a DTensor norm that
    already covers all shards; ``full_tensor`` makes it a plain value every rank agrees on.
    """
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return full_tensor(norm)


@contextmanager
def gathered_for_sampling(model: nn.Module) -> Iterator[nn.Module]:
    """Keep an FSDP2 model's parameters gathered across a whole generation, then reshard.

    Without this, every decoding step would all-gather every block again (one forward per token).
    Sampling needs the full parameters anyway; the memory is one full copy of the weights, which
    generation needs at its peak in any case. DDP and plain modules pass through unchanged.
    """
    if not is_fsdp(model):
        yield unwrap(model)
        return
    model.set_reshard_after_forward(False)
    try:
        yield model
    finally:
        model.set_reshard_after_forward(True)
        for module in model.modules():
            if is_fsdp(module):
                module.reshard()
