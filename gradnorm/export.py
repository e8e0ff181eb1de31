"""A trained Hugging Face policy as a directory any Hugging Face tool loads (``save_pretrained``).

The trainer does it at the end of every Hugging Face run, into ``output-dir/final/`` (or
``--export-hf DIR``; ``--export-hf none`` skips it). This command converts any checkpoint of a
finished or interrupted run, without a GPU or a process group:

    python -m gradnorm.export runs/grpo --out runs/grpo/final         # the latest checkpoint
    python -m gradnorm.export runs/grpo --out exports/grpo-step100 --step 100

The target is a new or empty directory, or an earlier export (which is replaced); anything else is
refused before anything is written: the current directory, the run itself or anything in it but its
``final/``, someone else's files (the rule and its reasons: ``gradnorm.trainer.guards.outpaths``). Bad input is
one ``error:`` line and exit code 2, as for the trainer; a failed write is exit code 1.

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

import sys

from gradnorm.cli.oneline import OneLineParser  # the trainer's too: one error: line, exit code 2
from gradnorm.trainer.checkpoint.export import CheckpointError, export_checkpoint, save_trained, write_pretrained  # noqa: F401 (the API)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m gradnorm.export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run's output directory (config.json and ckpt_step*/)")
    parser.add_argument("--out", required=True, help="the directory to write: new, empty, or an earlier export "
                        "(replaced); never the run itself or anything in it but RUN_DIR/final")
    parser.add_argument("--step", type=int, default=None, help="which checkpoint (default: the latest complete one)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.run_dir, args.out, args.step)
    except (ValueError, ImportError) as err:  # bad input or environment, found before anything is written
        print(f"error: {err}", file=sys.stderr)
        return 2
    except CheckpointError as err:  # a failed write (a full disk...), whatever the writer raised
        print(f"error: could not export to {args.out} ({err}); nothing was written there", file=sys.stderr)
        return 1
    except OSError as err:  # reading the checkpoint failed
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"saved {out} (AutoModelForCausalLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
