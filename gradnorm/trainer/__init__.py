"""The GRPO trainer behind ``gradnorm/train.py``: the pieces of a step as modules (config, policy,
warm-up, rollout, scoring, chunks, packing, step, record), and three concerns around the step as
packages: ``guards`` (what stops a run cleanly), ``rundir`` (the run directory and its logs) and
``checkpoint`` (what a run saves, when, and its export). ``docs/design.md`` maps each module."""
