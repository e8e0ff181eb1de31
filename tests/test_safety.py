"""Untrusted files never run code, and the one server the tests start is reachable only locally, with a token.

These replace two checks that grepped source text (a ``weights_only=True`` on the same line as
``torch.load``; the server flags in tests/test_browser.py): a grep passes for code that never runs
and fails for a harmless reformatting. Here the behaviour is exercised:

- poisoned files, whose unpickling would run ``os.system("touch PWNED")``, go through the
  library's loaders: ``checkpointing.load`` (what ``--resume`` uses) in every container torch can
  read, and ``hfmodels.load_causal_lm`` (what ``--model DIR`` uses) with a poisoned
  ``pytorch_model.bin``; each is refused and the file PWNED never appears. The control: the same
  payload through a plain ``pickle.load`` does create it, so the check can fail;
- JupyterLab started by tests/test_browser.py's own ``lab`` fixture: every socket its process
  listens on is bound to 127.0.0.1, and its API answers 403 without the token or with a wrong one.
"""

import io
import os
import pickle
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from gradnorm import checkpointing


class Payload:
    """Unpickling this runs a shell command that creates ``target``."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def poisoned_files(target: Path) -> dict[str, bytes]:
    """The payload in every form torch.load accepts, and hidden where a real checkpoint keeps state."""
    ckpt = {"model": {"w": torch.zeros(2)}, "optimizer": {"state": {0: {"exp_avg": Payload(target)}}},
            "step": 1, "rng": {}, "warmup": {}, "elapsed_s": 0.0}
    files = {}
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        files[f"raw-pickle-{protocol}"] = pickle.dumps(Payload(target), protocol=protocol)
    for name, zipped in (("torch-zip", True), ("torch-legacy", False)):
        buffer = io.BytesIO()
        torch.save(ckpt, buffer, _use_new_zipfile_serialization=zipped)
        files[name] = buffer.getvalue()
    return files


@pytest.mark.parametrize("kind", ["raw-pickle-2", f"raw-pickle-{pickle.HIGHEST_PROTOCOL}", "torch-zip", "torch-legacy"])
def test_a_poisoned_checkpoint_is_refused_and_its_payload_never_runs(kind, tmp_path):
    target = tmp_path / "PWNED"
    path = tmp_path / "ckpt_step1.pt"
    path.write_bytes(poisoned_files(target)[kind])
    with pytest.raises(ValueError, match="refused by the safe unpickler") as err:
        checkpointing.load(path, required=checkpointing.TRAINER_KEYS)
    assert "\n" not in str(err.value) and "weights_only=False" not in str(err.value)
    assert not target.exists()


def test_control_the_payload_does_run_when_unpickled_unsafely(tmp_path):
    target = tmp_path / "PWNED"
    pickle.loads(poisoned_files(target)["raw-pickle-2"])  # what torch.load(weights_only=False) would do
    assert target.exists()


def test_a_poisoned_hugging_face_model_never_runs_its_payload(tmp_path):
    pytest.importorskip("transformers")
    from gradnorm import hfmodels

    target = tmp_path / "PWNED"
    model_dir = hfmodels.build_tiny_llama(tmp_path / "tiny-llama", seed=0)
    (model_dir / "model.safetensors").unlink()  # transformers falls back to pytorch_model.bin
    (model_dir / "pytorch_model.bin").write_bytes(poisoned_files(target)["torch-zip"])
    with pytest.raises(Exception):
        hfmodels.load_causal_lm(str(model_dir), pad_id=0)
    assert not target.exists()


# ------------------------------------------------------------------ the test suite's server

from test_browser import lab  # noqa: E402,F401  tests/test_browser.py's session fixture, the server itself


def listening_addresses(port: int) -> set[str]:
    """Every address that the process serving ``port`` (and its children) listens on."""
    psutil = pytest.importorskip("psutil")
    owners = {c.pid for c in psutil.net_connections(kind="inet") if c.laddr and c.laddr.port == port
              and c.status == psutil.CONN_LISTEN}
    assert len(owners) == 1, owners
    server = psutil.Process(owners.pop())
    found = set()
    for proc in [server, *server.children(recursive=True)]:
        found |= {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    return found


def status_code(url: str, token: str | None) -> int:
    headers = {"Authorization": f"token {token}"} if token is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.fixture(scope="module")
def server(request):
    pytest.importorskip("jupyterlab")
    return request.getfixturevalue("lab")


def test_the_notebook_server_listens_on_localhost_only_and_needs_its_token(server):
    lab = server
    port = int(lab.base_url.rstrip("/").rsplit(":", 1)[1])
    assert listening_addresses(port) == {"127.0.0.1"}
    url = f"{lab.base_url}api/sessions"
    assert status_code(url, lab.token) == 200
    assert status_code(url, None) == 403
    assert status_code(url, "0" * len(lab.token)) == 403
