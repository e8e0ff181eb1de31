"""The GPU check script: on a machine without CUDA it says so in one line and exits 1.

Its table needs a GPU; ``python benchmarks/gpu_check.py --allow-cpu`` runs the same launches on CPU
by hand (about a minute), which is how the script itself was exercised without one.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    """The script as a module (it lives outside the package, as a script should)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_the_check_explains_and_exits_1(gpu_check, capsys):
    assert gpu_check.main([]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("gpu_check: no CUDA device here")


def test_a_row_names_the_model_size(gpu_check, tmp_path):
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_llama

    assert gpu_check.describe(build_tiny_llama(tmp_path)) == "Llama 2x32 (24k params)"
