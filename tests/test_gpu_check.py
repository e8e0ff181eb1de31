"""The GPU check script: on a machine without CUDA it says so in one line and exits 1.

Its table needs a GPU; ``python -m gradnorm.gpu_check --allow-cpu`` runs the same launches on CPU
by hand (about a minute), which is how the script itself was exercised without one.
"""

import pytest
import torch

from gradnorm import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_the_check_explains_and_exits_1(capsys):
    assert gpu_check.main([]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("gpu_check: no CUDA device here")


def test_a_row_names_the_model_size(tmp_path):
    pytest.importorskip("transformers")
    from gradnorm.hfmodels import build_tiny_llama

    assert gpu_check.describe(build_tiny_llama(tmp_path)) == "Llama 2x32 (24k params)"
