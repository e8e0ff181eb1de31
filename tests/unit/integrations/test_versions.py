"""The integrations that read a framework's internals refuse a version they were not tested with, in one line."""

import pytest

import trl  # the trainers extra installs it (make install)


def test_grpo_trainer_refuses_an_untested_trl(monkeypatch):
    from gradnorm.integrations import trl_grpo

    monkeypatch.setattr(trl, "__version__", "0.0.1")
    with pytest.raises(RuntimeError, match=r"tested with trl 1\.16\.0, not 0\.0\.1") as err:
        trl_grpo.GlobalTokenGRPOTrainer()
    assert "\n" not in str(err.value)


def test_grpo_trainer_accepts_the_tested_trl():
    from gradnorm.integrations import trl_grpo

    assert trl.__version__ in trl_grpo.TESTED["trl"]  # control: the pinned version passes the check
    trl_grpo._check_version()
