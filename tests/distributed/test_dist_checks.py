"""One optimizer step on real gloo processes against its in-process simulation (``gradnorm.teach.checks``)."""

import pytest

from gradnorm.teach.checks import ddp_check
from gradnorm.teach.sweeps import ragged_lengths

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def test_ddp_check_rejects_lengths_run_ddp_cannot_build():
    with pytest.raises(ValueError):
        ddp_check([13, 1, 1, 1])


@pytest.mark.launch
def test_ddp_check_on_real_processes():
    checks = ddp_check(ragged_lengths(12, 16), modes=("local", "token"), world_size=2, accum_steps=2)
    assert [c.mode for c in checks] == ["local", "token"]
    assert all(c.max_abs_diff < 1e-12 for c in checks)
    assert checks[1].relative_error < 1e-12 and checks[0].relative_error > 0.1
