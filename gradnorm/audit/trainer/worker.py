"""One trainer process of a trainer audit: ``python -m gradnorm.audit.trainer.worker SPEC.json`` (under torchrun or not).

It installs the recorder (``gradnorm.audit.trainer.recorder``), loads the probe model, its tokenizer and
the probe data set, calls the user's build function with the keywords it asks for, and trains
the trainer it returns. The recorder writes this rank's gradient at the first optimizer step. A
failure is one line in ``error.rank<R>.txt`` in the probe output folder and exit status 3; the
audit reports it (``gradnorm.audit.trainer.launch``).

The build function may ask for any of ``BUILD_KEYWORDS``, by name::

    def build(model, tokenizer, train_dataset, *, output_dir, world_size, accum_steps, per_device_batch):
        return Trainer(model=model, args=TrainingArguments(output_dir, per_device_train_batch_size=per_device_batch,
                       gradient_accumulation_steps=accum_steps, ...), train_dataset=..., ...)
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

BUILD_KEYWORDS = {
    "model": "the probe model, loaded with AutoModelForCausalLM.from_pretrained(model_path)",
    "tokenizer": "its tokenizer (AutoTokenizer.from_pretrained(model_path))",
    "train_dataset": "the probe data set: a datasets.Dataset of the records (a list where datasets is missing)",
    "model_path": "the folder of the probe model and tokenizer",
    "data_path": "the probe data set as a JSONL file",
    "output_dir": "a folder of the audit's own for the trainer's files",
    "world_size": "W of this configuration",
    "accum_steps": "A: gradient accumulation steps",
    "per_device_batch": "examples per rank and microbatch (SFT, DPO: W * A * per_device_batch = the data set; GRPO: "
                        "completions, W * A * per_device_batch = the completions of one optimizer step)",
    "reward_func": "GRPO: the probe's reward, TRL's signature (prompts, completions, **kwargs) -> list[float]",
    "num_generations": "GRPO: completions per prompt, 2 (what the probe's advantages need)",
}


def _error_path(out: Path) -> Path:
    return out / f"error.rank{os.environ.get('RANK', '0')}.txt"


def _model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _dataset(path: str):
    """The probe's records as a datasets.Dataset (a list of dicts where datasets is not installed)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    try:
        import datasets
    except ImportError:
        return records
    return datasets.Dataset.from_list(records)


def run(spec: dict) -> None:
    """Build the user's trainer with what it asks for (each made only if asked: a build that fails, fails fast)."""
    from gradnorm.audit.trainer.recorder import install

    install()
    import torch

    from gradnorm.audit.trainer.data import parity_reward
    from gradnorm.cli.usercode import load_function

    torch.set_num_threads(1)
    build = load_function(spec["build"])
    offered = {"model": lambda: _model(spec["model_path"]), "tokenizer": lambda: _tokenizer(spec["model_path"]),
               "train_dataset": lambda: _dataset(spec["data_path"]), "reward_func": lambda: parity_reward,
               "num_generations": lambda: 2, **{k: (lambda k=k: spec[k]) for k in BUILD_KEYWORDS if k in spec}}
    params = inspect.signature(build).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: make() for k, make in offered.items() if takes_all or k in params}
    trainer = build(**kwargs)
    if not callable(getattr(trainer, "train", None)):
        raise TypeError(f"{spec['build']} returned {type(trainer).__name__}, not a trainer with a .train() method")
    trainer.train()


def main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(os.environ["GRADNORM_PROBE_OUT"])
    code = 0
    try:
        run(spec)
    except BaseException as err:  # the user's build or trainer failed: one line for the audit to report
        from gradnorm.cli.usercode import describe

        out.mkdir(parents=True, exist_ok=True)
        _error_path(out).write_text(describe(err))
        code = 3
    from gradnorm.dist.comm import exit_without_finalizing

    exit_without_finalizing(code)  # a gloo thread may abort a finalizing interpreter (see there)


if __name__ == "__main__":
    main(sys.argv[1:])
