"""Training state as named tensors, written and read with torch.distributed.checkpoint (DCP).

Part of the thin distributed shell. One code path for every ``--parallel`` and for the plain
one-process run:

- ``training_state(model, opt, ref)`` names everything by parameter name (torch's
  ``get_state_dict``): the model's weights, AdamW's ``exp_avg``/``exp_avg_sq``/``step`` under
  ``optimizer.state.<name>.*``, and the frozen reference policy. Under FSDP2 a tensor is a
  DTensor holding this rank's shard: nothing is gathered or copied. Under DDP and alone it is the
  full tensor. Names, not indices, are what let a DDP checkpoint resume under FSDP2 and back.
- ``write(state, directory)``: every rank writes its own file (``__{rank}_0.distcp``) in
  parallel; DCP writes each replicated tensor (DDP) once, spreading them over ranks; the
  coordinator writes ``.metadata`` (a pickle) last, after gathering every rank's outcome, so a
  failure on any rank raises on every rank.
- ``read(state, directory)`` fills ``state``'s tensors in place from any checkpoint, whatever the
  world size and ``--parallel`` that wrote it: a DTensor placeholder receives this rank's shard
  of the current layout (resharding), a plain tensor the whole tensor.

Loading untrusted files, exactly (torch 2.13, ``torch/distributed/checkpoint/``):

1. ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with Python's unrestricted
   ``pickle`` module: no allow-list at all. ``_SafeReader`` replaces that method with
   ``read_metadata`` here, whose ``_MetadataUnpickler`` resolves only the DCP metadata classes,
   torch dtypes, ``torch.Size``, the layout decoder and ``pathlib`` paths (the globals a real
   ``.metadata`` holds). Anything else (``os.system`` in a ``__reduce__``...) raises
   ``RefusedPickle`` before any object is built. Storage paths must be bare file names inside
   the checkpoint directory.
2. Tensor payloads are read by ``FileSystemReader.read_data`` with
   ``torch.load(weights_only=True)``: the safe unpickler, already.
3. Non-tensor items (the optimizer's ``param_groups``: lr, betas... stored by DCP as pickled
   bytes) would go through ``DefaultLoadPlanner.load_bytes``, which calls ``torch.load`` with
   ``weights_only=False``. ``read`` therefore asks DCP for tensors only (the hyperparameters
   come from this run's flags), and ``_SafePlanner.load_bytes`` refuses if anything asks for more.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from gradnorm.dist.wrap import unwrap

METADATA_FILE = ".metadata"
"""DCP's index of a checkpoint directory, written last by the coordinator."""


# ------------------------------------------------------------------ the state, named


def training_state(model: nn.Module, opt: torch.optim.Optimizer, ref: nn.Module | None = None) -> dict[str, Any]:
    """{"model", "optimizer"[, "ref"]}, keyed by parameter name; this rank's shards under FSDP2.

    Before the optimizer's first step torch creates AdamW's state with a zero-gradient step at
    lr 0 (no weight changes), so a fresh optimizer has the placeholders a load fills. That step
    also counts itself (step = 1), which would change the next update's bias correction: a save
    after skipped first steps, or a resume, would alter training. Zero moments at step 0 are
    exactly AdamW's fresh state, so the count is put back.
    """
    fresh = not opt.state
    model_state, optim_state = get_state_dict(unwrap(model), opt)
    if fresh:
        for param_state in opt.state.values():
            param_state["step"].zero_()
    state = {"model": model_state, "optimizer": optim_state}
    if ref is not None:  # replicated on every rank, a plain module: DCP writes each tensor once
        state["ref"] = ref.state_dict()
    return state


def apply_training_state(model: nn.Module, opt: torch.optim.Optimizer, ref: nn.Module | None, state: dict) -> None:
    """Load what ``read`` filled into the model, the optimizer and the reference.

    The placeholders ``training_state`` returns are mostly the live tensors themselves (so
    ``read`` already wrote into them), but torch does not promise that, nor for the
    optimizer's step counts; this is the documented way back.
    """
    set_state_dict(unwrap(model), opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if ref is not None:
        ref.load_state_dict(state["ref"])


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """The whole model's weights on rank 0's CPU (other ranks: {}), for a Hugging Face export.

    A collective under FSDP2 (every rank must call it). Only the weights travel to rank 0, never
    the optimizer state; checkpoints never go through here.
    """
    return get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def tensor_leaves(state: Any, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    """(DCP key, tensor) for every tensor in a nested state: dict keys and list indices joined by dots."""
    if isinstance(state, Tensor):
        yield prefix, state
    elif isinstance(state, dict | list | tuple):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        for key, value in items:
            yield from tensor_leaves(value, f"{prefix}.{key}" if prefix else str(key))


def tensors_only(state: Any) -> Any:
    """The same nesting with only the tensors (the same objects, so a load into it fills ``state``);
    lists (the optimizer's param_groups) and other values are left out."""
    if isinstance(state, dict):
        kept = {k: tensors_only(v) for k, v in state.items()}
        return {k: v for k, v in kept.items() if v is not None}
    return state if isinstance(state, Tensor) else None


# ------------------------------------------------------------------ write and read


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _first_failure(err: CheckpointException) -> BaseException:
    """The exception of the lowest failing rank inside DCP's wrapper (whose str is a traceback)."""
    failures = err.failures
    return failures[min(failures)][0] if failures else err


def write(state: dict[str, Any], directory: Path) -> None:
    """Every rank writes its part of ``state`` into ``directory``; an I/O failure on any rank is an
    ``OSError`` on every rank (DCP gathers every rank's outcome before writing ``.metadata``)."""
    try:
        with _quiet():
            dcp.save(state, storage_writer=FileSystemWriter(str(directory), single_file_per_rank=True,
                                                            sync_files=True))
    except CheckpointException as err:
        cause = _first_failure(err)
        raise (cause if isinstance(cause, OSError) else OSError(f"{type(cause).__name__}: {cause}")) from None


def read(state: dict[str, Any], directory: Path) -> None:
    """Fill the tensors of ``state`` in place from the checkpoint in ``directory`` (any world size).

    Only tensors are requested (see the module docstring); a key missing from the checkpoint,
    a truncated file or a payload the safe unpickler refuses raises the underlying error.
    """
    try:
        with _quiet():
            dcp.load(tensors_only(state), storage_reader=_SafeReader(str(directory)), planner=_SafePlanner())
    except CheckpointException as err:
        raise _first_failure(err) from None


class _SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # The default unpickles with weights_only=False (any pickle); read() never asks for bytes.
        raise pickle.UnpicklingError(f"{read_item.dest_index.fqn} is a pickled object; only tensors are read")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError("per-rank metadata is never written by gradnorm")
        metadata = read_metadata(Path(self.path))
        metadata.storage_meta = StorageMeta(load_id=self.load_id)  # what the parent method sets
        return metadata


# ------------------------------------------------------------------ .metadata, unpickled safely


class RefusedPickle(pickle.UnpicklingError):
    """A ``.metadata`` pickle names a global outside the allow-list (it may be malicious)."""


def _allowed_globals() -> set[tuple[str, str]]:
    metadata_classes = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    allowed = {("torch.distributed.checkpoint.metadata", name) for name in metadata_classes}
    allowed |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath")}
    allowed |= {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise RefusedPickle(f"it references {module}.{name}")
        return super().find_class(module, name)


def read_metadata(directory: Path) -> Metadata:
    """A checkpoint's ``.metadata``, unpickled with the allow-list; ``RefusedPickle`` otherwise.

    Corrupt bytes raise what the unpickler raises (``UnpicklingError``, ``EOFError``...).
    """
    with open(Path(directory) / METADATA_FILE, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise RefusedPickle(f"it holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or Path(name).name != name or name in (".", ".."):
            raise RefusedPickle(f"it points outside its directory ({name!r})")
    return metadata


def stored_tensors(metadata: Metadata) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{DCP key: (global shape, dtype)} of every tensor in a checkpoint."""
    return {key: (tuple(md.size), md.properties.dtype) for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}
