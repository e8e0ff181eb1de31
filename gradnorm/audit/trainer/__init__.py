"""The trainer audit: every token's weight read out of a whole real trainer, unchanged, on real ranks.

- ``model``      the probe: a zero-layer Llama whose head gradient has a column per input id
- ``data``       probe data sets (SFT texts, DPO pairs, GRPO prompts and the parity reward)
- ``recorder``   inside each trainer process: the probe's inputs, the head's gradient at the first step
- ``launch``     one launch per configuration (torchrun or one process); ``worker`` runs a build in it;
                 ``site/sitecustomize.py`` installs the recorder in a script's processes
- ``readout``    SFT and DPO: each token's weight and the plan the trainer ran
- ``generated``  GRPO: the sampled batch read back, each run against the modes on its own batch
- ``audit``      ``audit_trainer`` and ``audit_script``: the runs, then the loss audit's report
- ``cli``        ``python -m gradnorm.audit --trainer BUILD`` and ``--script -- COMMAND``

docs/audit.md ("A whole trainer") says how it measures and which trainers were measured.
"""
