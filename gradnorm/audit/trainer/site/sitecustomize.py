"""Loaded by Python at start-up in every process of a command that ``python -m gradnorm.audit --script``
runs (this folder is put first on PYTHONPATH): it installs the probe's recorder, nothing else."""

import os

if os.environ.get("GRADNORM_PROBE_OUT"):
    from gradnorm.audit.trainer.recorder import install

    install()
