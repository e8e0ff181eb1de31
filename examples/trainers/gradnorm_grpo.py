"""gradnorm's own GRPO trainer (gradnorm/train.py), unchanged, as build functions for the trainer audit.

    python -m gradnorm.audit --trainer examples/trainers/gradnorm_grpo.py:build --objective grpo
    python -m gradnorm.audit --trainer examples/trainers/gradnorm_grpo.py:build_sequence --objective grpo
    python -m gradnorm.audit --trainer examples/trainers/gradnorm_grpo.py:build_constant --objective grpo
    python -m gradnorm.audit --trainer examples/trainers/gradnorm_grpo.py:build_local --objective grpo

Each build returns an object whose ``train()`` runs the trainer's ``main(argv)`` in the launched
process (under torchrun it joins the launch's process group, as ``torchrun gradnorm/train.py``
would) on the probe model and prompts, with the probe's reward by name
(``gradnorm.audit.trainer.data:parity_of_response``), two completions a prompt, one GRPO step and
the audit's accumulation steps. Each passes one ``--loss-denominator``: ``build`` the default
(``token``), ``build_sequence``, ``build_constant`` (C = ``CONSTANT``) and ``build_local`` (a
microbatch's own mean, the control that must read SKEWED).

``--max-new-tokens`` is ``MAX_NEW_TOKENS``: the probe ends a completion with probability 1/4 after
every token, so a completion the trainer cuts at its maximum has probability 0.75**63, about 1e-8
(the readout refuses one it cannot read rather than guess).
"""

MAX_NEW_TOKENS = 64
CONSTANT = 64.0


class _Run:
    """What the audit's worker calls ``.train()`` on: gradnorm/train.py's ``main`` with these flags."""

    def __init__(self, argv: list[str]):
        self.argv = argv

    def train(self) -> None:
        from gradnorm.train import main

        code = main(self.argv)
        if code != 0:
            raise RuntimeError(f"gradnorm/train.py {' '.join(self.argv)} exited with {code}")


def _run(denominator: str, model_path, data_path, output_dir, accum_steps, world_size, per_device_batch) -> _Run:
    completions = world_size * accum_steps * per_device_batch  # one optimizer step's, two a prompt
    return _Run(["--model", str(model_path), "--prompts", str(data_path),
                 "--reward", "gradnorm.audit.trainer.data:parity_of_response", "--group-size", "2",
                 "--prompts-per-step", str(completions // 2), "--grad-accum-steps", str(accum_steps),
                 "--loss-denominator", denominator, "--max-new-tokens", str(MAX_NEW_TOKENS), "--steps", "1",
                 "--eval-prompts", "2", "--no-plot", "--export-hf", "none", "--device", "cpu",
                 "--output-dir", str(output_dir), "--save-every", "0", "--gradient-checkpointing",
                 "--seed", str(world_size * accum_steps - 1)])


def build(model_path, data_path, *, output_dir, world_size, accum_steps, per_device_batch):
    return _run("token", model_path, data_path, output_dir, accum_steps, world_size, per_device_batch)


def build_sequence(model_path, data_path, *, output_dir, world_size, accum_steps, per_device_batch):
    return _run("sequence", model_path, data_path, output_dir, accum_steps, world_size, per_device_batch)


def build_constant(model_path, data_path, *, output_dir, world_size, accum_steps, per_device_batch):
    return _run(f"{CONSTANT:g}", model_path, data_path, output_dir, accum_steps, world_size, per_device_batch)


def build_local(model_path, data_path, *, output_dir, world_size, accum_steps, per_device_batch):
    return _run("local", model_path, data_path, output_dir, accum_steps, world_size, per_device_batch)
