"""The GRPO trainer behind ``gradnorm/train.py``: the pieces of a step as modules (config, policy,
warm-up, rollout, scoring, chunks, packing, step, record), and four concerns around the step as
packages: ``guards`` (what stops a run cleanly), ``ownership`` (who owns the run
directory: the lock, ``--overwrite``, ``--resume``), ``logs`` (what a run writes about itself) and
``checkpoint`` (what a run saves, when, and its export). ``docs/design.md`` maps each module."""
