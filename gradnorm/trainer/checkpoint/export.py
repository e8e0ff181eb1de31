"""The trained policy as a Hugging Face directory (``save_pretrained``-ready): at the end of a run,
or from any checkpoint (``python -m gradnorm.export``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from gradnorm.dist import comm
from gradnorm.dist import state as dist_state
from gradnorm.models import hf
from gradnorm.trainer.checkpoint.store import CheckpointError, checkpoint_dir, described, latest_checkpoint, read_tensors
from gradnorm.trainer.guards import outpaths


def write_pretrained(config: Any, weights: dict[str, torch.Tensor], tokenizer: Any, out_dir: str | Path) -> Path:
    """``save_pretrained`` of a model with ``config`` and ``weights``, plus ``tokenizer``, atomically.

    Written to ``.{name}.tmp`` beside ``out_dir``, then renamed over it: an interrupted export
    leaves no half directory that ``from_pretrained`` could pick up. Only a directory an export
    wrote is ever deleted (``gradnorm.trainer.guards.outpaths``); anything else is a one-line ValueError first.
    A failed write (a full disk...) is a CheckpointError that says why in one line, whatever raised it.
    """
    transformers = hf.require_transformers()
    out = outpaths.check_export_dir(out_dir, flag="the export directory")  # checked again: a run lasts days
    tmp = outpaths.temporary(out)
    config = copy.deepcopy(config)
    config.use_cache = True  # training turned the KV cache off; generation elsewhere wants it
    with torch.device("meta"):  # no second copy of the weights: they are assigned below
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, assign=True, strict=True)
    model.tie_weights()  # assign broke the tie of tied embeddings (the values are equal)
    outpaths.remove(tmp)  # a killed export's leftover (marked), never someone else's
    outpaths.create(tmp)
    try:
        model.save_pretrained(tmp)  # safetensors
        tokenizer.save_pretrained(tmp)
        outpaths.remove(out)
        os.replace(tmp, out)
    except Exception as err:  # a full disk: safetensors raises its own SafetensorError, no OSError
        raise CheckpointError(described(err, out.parent)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def save_trained(model: torch.nn.Module, tokenizer: Any, out_dir: Path, is_main: bool) -> None:
    """The trainer's export at the end of a run. Every rank must call it (a collective under FSDP2)."""
    weights = dist_state.full_model_state(model)  # full on rank 0, {} elsewhere
    error = None
    if is_main:
        try:
            write_pretrained(model.config, weights, tokenizer, out_dir)
            print(f"trained policy saved to {out_dir} (AutoModelForCausalLM.from_pretrained)", flush=True)
        except Exception as err:  # a full disk (safetensors' own error), the target changed since the preflight:
            error = err  # every rank must learn it, or the others wait in all_true
    if not comm.all_true(error is None):
        what = (str(error) if isinstance(error, CheckpointError) else described(error, out_dir)) if error is not None \
            else "it failed on rank 0"
        raise CheckpointError(f"could not export the trained policy to {out_dir} ({what}); "
                                            "the checkpoints are intact: python -m gradnorm.export converts them")


def export_checkpoint(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> Path:
    """Convert a run's checkpoint (the latest complete one, or ``step``) to ``out_dir``; ValueError otherwise."""
    outpaths.check_export_dir(out_dir, run_dir)  # before anything is read: the run itself may be the target
    run_dir = Path(run_dir)
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{run_dir}: cannot read the run's config.json ({err})") from None
    name = config.get("model", "tiny")
    if name == "tiny":
        raise ValueError(f"{run_dir} trained the built-in TinyGPT, which is not a Hugging Face model")
    ckpt = latest_checkpoint(run_dir) if step is None else checkpoint_dir(run_dir, step)
    if ckpt is None or not ckpt.is_dir():
        raise ValueError(f"{run_dir}: no complete checkpoint {'ckpt_step*' if step is None else ckpt.name}/")
    weights = read_tensors(ckpt, "model")
    tokenizer = hf.load_tokenizer(name)
    model_config = hf.require_transformers().AutoConfig.from_pretrained(name)
    model_config.pad_token_id = tokenizer.pad_token_id  # as hf.load_causal_lm set it for training
    return write_pretrained(model_config, weights, tokenizer, out_dir)
