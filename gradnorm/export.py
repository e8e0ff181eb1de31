"""A trained Hugging Face policy as a directory any Hugging Face tool loads (``save_pretrained``).

The trainer does it at the end of every Hugging Face run, into ``output-dir/final/`` (or
``--export-hf DIR``; ``--export-hf none`` skips it). This command converts any checkpoint of a
finished or interrupted run, without a GPU or a process group:

    python -m gradnorm.export runs/grpo --out runs/grpo/hf            # the latest checkpoint
    python -m gradnorm.export runs/grpo --out runs/grpo/hf100 --step 100

and then, anywhere (vLLM, lm-eval, transformers...):

    AutoModelForCausalLM.from_pretrained("runs/grpo/final"); AutoTokenizer.from_pretrained("runs/grpo/final")

The directory holds ``config.json`` (``use_cache`` back on, ``pad_token_id`` as trained), the
weights as safetensors (``model.safetensors``, or shards with an index for large models), the
generation config and the tokenizer. Weights are the fp32 master weights the optimizer trained.

Memory: under FSDP2 the trainer gathers the full weights on rank 0's CPU
(``get_model_state_dict(full_state_dict=True, cpu_offload=True)``), never the optimizer state;
the command reads only the ``model.*`` tensors of the checkpoint. Either way the model is built on
the meta device and the weights are assigned, not copied, so the host holds them once.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from gradnorm.trainer import checkpointing
from gradnorm.models import hf as hfmodels
from gradnorm.dist import comm
from gradnorm.dist import state as dist_state


def write_pretrained(config: Any, weights: dict[str, torch.Tensor], tokenizer: Any, out_dir: str | Path) -> Path:
    """``save_pretrained`` of a model with ``config`` and ``weights``, plus ``tokenizer``, atomically.

    Written to ``.{name}.tmp`` beside ``out_dir``, then renamed over it: an interrupted export
    leaves no half directory that ``from_pretrained`` could pick up.
    """
    transformers = hfmodels.require_transformers()
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.tmp"
    config = copy.deepcopy(config)
    config.use_cache = True  # training turned the KV cache off; generation elsewhere wants it
    with torch.device("meta"):  # no second copy of the weights: they are assigned below
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, assign=True, strict=True)
    model.tie_weights()  # assign broke the tie of tied embeddings (the values are equal)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        model.save_pretrained(tmp)  # safetensors
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
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
        except OSError as err:
            error = err
    if not comm.all_true(error is None):
        raise checkpointing.CheckpointError(f"could not export the trained policy to {out_dir} ({error}); "
                                            "the checkpoints are intact: python -m gradnorm.export converts them")


def export_checkpoint(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> Path:
    """Convert a run's checkpoint (the latest complete one, or ``step``) to ``out_dir``; ValueError otherwise."""
    run_dir = Path(run_dir)
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{run_dir}: cannot read the run's config.json ({err})") from None
    name = config.get("model", "tiny")
    if name == "tiny":
        raise ValueError(f"{run_dir} trained the built-in TinyGPT, which is not a Hugging Face model")
    ckpt = checkpointing.latest_checkpoint(run_dir) if step is None else checkpointing.checkpoint_dir(run_dir, step)
    if ckpt is None or not ckpt.is_dir():
        raise ValueError(f"{run_dir}: no complete checkpoint {'ckpt_step*' if step is None else ckpt.name}/")
    weights = checkpointing.read_tensors(ckpt, "model")
    tokenizer = hfmodels.load_tokenizer(name)
    model_config = hfmodels.require_transformers().AutoConfig.from_pretrained(name)
    model_config.pad_token_id = tokenizer.pad_token_id  # as hfmodels.load_causal_lm set it for training
    return write_pretrained(model_config, weights, tokenizer, out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradnorm.export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run's output directory (config.json and ckpt_step*/)")
    parser.add_argument("--out", required=True, help="the directory to write (replaced if it exists)")
    parser.add_argument("--step", type=int, default=None, help="which checkpoint (default: the latest complete one)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.run_dir, args.out, args.step)
    except (ValueError, ImportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"saved {out} (AutoModelForCausalLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
