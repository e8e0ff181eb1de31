"""The GRPO trainer behind ``gradnorm/train.py``: configuration, policy, rollout, step, run files,
checkpoints and the guards that stop a run cleanly. ``docs/design.md`` maps each module."""
