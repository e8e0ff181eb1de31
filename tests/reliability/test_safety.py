"""Untrusted files never run code, and the one server the tests start is reachable only locally, with a token.

These replace two checks that grepped source text (a ``weights_only=True`` on the same line as
``torch.load``; the server flags in tests/helpers/jupyterlab.py): a grep passes for code that never runs
and fails for a harmless reformatting. Here the behaviour is exercised.

Every loader a user can point at a file of unknown origin gets poisoned files, whose unpickling
would run ``os.system("touch PWNED")``; each refuses them (or never unpickles them) and the file
PWNED never appears:

- ``--resume`` (``store.load``) on a checkpoint directory with a poisoned ``.metadata`` or
  a poisoned tensor payload: tests/reliability/test_reliability.py::test_a_bad_checkpoint_is_one_line_and_never_executed
  runs both through ``main()``, tests/e2e/test_checkpoints.py the ``.metadata`` allow-list itself; not
  repeated here;
- ``python -m gradnorm.export RUN`` (``store.read_tensors``) on a checkpoint poisoned in
  every container a loader meets: ``.metadata`` pickled with protocol 2 and with the highest, a
  tensor payload saved by ``torch.save`` in its zip and in its legacy format. One ``error:`` line,
  exit 2 (bad input), nothing exported;
- the objects DCP pickles beside the tensors (the optimizer's ``param_groups``), which DCP's own
  loader unpickles with ``weights_only=False``: a checkpoint whose ``param_groups`` entry is poisoned
  still loads through ``--resume``'s loader and the export's, since they ask DCP for tensors only;
- ``--model DIR`` (``hfmodels.load_causal_lm``) with a poisoned ``pytorch_model.bin``.

The controls: each poison does run through a loader without the guard (``pickle.loads``,
``torch.load(weights_only=False)`` of the very bytes DCP would read, DCP's own ``dcp.load``), so
none of these checks passes for a payload that would never have run anyway.

And JupyterLab, started by the session's ``lab`` fixture (tests/helpers/jupyterlab.py): every socket its process
listens on is bound to 127.0.0.1, and its API answers 403 without the token or with a wrong one.
"""

import io
import json
import os
import pickle
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tiny_models  # examples/tiny_models.py (tests/conftest.py puts it on the path)  # noqa: E402
import torch
from tests.helpers.trainer import one_error_line

from gradnorm import export
from gradnorm.dist import state as dist_state
from gradnorm.models.tinygpt import GPTConfig, TinyGPT
from gradnorm.trainer.checkpoint import checksums, store


class Payload:
    """Unpickling this runs a shell command that creates ``target``."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def torch_saved(obj, zipped: bool = True) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=zipped)
    return buffer.getvalue()


def fresh_state() -> dict:
    """The training state (named tensors, and AdamW's param_groups) of a tiny model and a fresh AdamW."""
    model = TinyGPT(GPTConfig(8, 8, 1, 2, 8))
    return dist_state.training_state(model, torch.optim.AdamW(model.parameters()))


def real_run(directory: Path) -> Path:
    """A run directory as a Hugging Face run leaves it: config.json and one real checkpoint; its checkpoint."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model": "some/model"}))
    return store.save(directory, 1, fresh_state(), {"step": 1}, rank=0)


def stored_item(ckpt: Path, prefix: str):
    """(metadata, storage record) of the first stored item whose key starts with ``prefix``.

    The test trusts its own .metadata, so it may use plain pickle here; gradnorm never does.
    """
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    return metadata, next(info for index, info in metadata.storage_data.items() if index.fqn.startswith(prefix))


def point_at(ckpt: Path, prefix: str, payload: bytes) -> None:
    """Append ``payload`` to a data file and point the first item whose key starts with ``prefix`` at it."""
    metadata, info = stored_item(ckpt, prefix)
    data = ckpt / info.relative_path
    info.offset, info.length = data.stat().st_size, len(payload)
    with open(data, "ab") as f:
        f.write(payload)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    for path in (data, ckpt / ".metadata"):  # whoever rewrites the files rewrites their sha256 too:
        checksums.write(path)  # the unpickler's guard must hold without the checksums' help


def read_slice(ckpt: Path, prefix: str) -> bytes:
    """The bytes DCP reads for the first item whose key starts with ``prefix``."""
    _, info = stored_item(ckpt, prefix)
    with open(ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


HIGHEST = pickle.HIGHEST_PROTOCOL
POISONS = {  # where the payload goes, and the refusal that names it
    "metadata-pickle-2": (lambda ckpt, t: (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(t), protocol=2)),
                          "refused by the safe unpickler of its .metadata: it references posix.system"),
    f"metadata-pickle-{HIGHEST}": (lambda ckpt, t: (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(t), HIGHEST)),
                                   "refused by the safe unpickler of its .metadata: it references posix.system"),
    "tensor-torch-zip": (lambda ckpt, t: point_at(ckpt, "model.", torch_saved({"w": Payload(t)}, zipped=True)),
                         "refused by the safe unpickler (weights_only=True): it references posix.system"),
    "tensor-torch-legacy": (lambda ckpt, t: point_at(ckpt, "model.", torch_saved({"w": Payload(t)}, zipped=False)),
                            "refused by the safe unpickler (weights_only=True): it references posix.system"),
}


@pytest.mark.parametrize("kind", POISONS)
def test_exporting_a_poisoned_checkpoint_is_one_line_and_its_payload_never_runs(kind, tmp_path, capsys):
    target, run = tmp_path / "PWNED", tmp_path / "run"
    poison, says = POISONS[kind]
    poison(real_run(run), target)
    assert export.main([str(run), "--out", str(tmp_path / "hf")]) == 2  # bad input: found before any write
    err = capsys.readouterr().err
    one_error_line(err, says)
    assert "weights_only=False" not in err  # torch's own message suggests it; ours never repeats it
    assert not target.exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kind", POISONS)
def test_control_each_poison_does_run_through_a_loader_without_the_guard(kind, tmp_path):
    target = tmp_path / "PWNED"
    ckpt = real_run(tmp_path / "run")
    POISONS[kind][0](ckpt, target)
    if kind.startswith("metadata"):
        pickle.loads((ckpt / ".metadata").read_bytes())  # what DCP's own FileSystemReader does
    else:  # the very bytes DCP would hand to torch.load, unpickled without the allow-list
        torch.load(io.BytesIO(read_slice(ckpt, "model.")), weights_only=False)
    assert target.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load without a process group: intended
def test_the_pickled_objects_beside_the_tensors_are_never_unpickled(tmp_path):
    """DCP stores param_groups (lr, betas...) as pickles and its loader would run them; ours never asks."""
    target = tmp_path / "PWNED"
    ckpt = real_run(tmp_path / "run")
    weights = store.read_tensors(ckpt, "model")
    point_at(ckpt, "optimizer.param_groups.", torch_saved(Payload(target)))
    state = fresh_state()
    store.load(ckpt, state, rank=0)  # --resume's loader: loads, the hyperparameters come from the flags
    for name, tensor in store.read_tensors(ckpt, "model").items():  # the export's loader
        assert torch.equal(tensor, weights[name]) and torch.equal(state["model"][name], weights[name]), name
    assert store.read_tensors(ckpt, "optimizer")  # even the part that holds param_groups
    assert not target.exists()
    # The control: DCP's own loader, asked for the whole state, runs the payload.
    import torch.distributed.checkpoint as dcp

    dcp.load(fresh_state(), checkpoint_id=str(ckpt))
    assert target.exists()


def test_a_poisoned_hugging_face_model_never_runs_its_payload(tmp_path):
    pytest.importorskip("transformers")
    from gradnorm.models import hf as hfmodels

    target = tmp_path / "PWNED"
    model_dir = tiny_models.build_tiny_llama(tmp_path / "tiny-llama", seed=0)
    (model_dir / "model.safetensors").unlink()  # transformers falls back to pytorch_model.bin
    (model_dir / "pytorch_model.bin").write_bytes(torch_saved({"lm_head.weight": Payload(target)}))
    with pytest.raises(ValueError, match="refused by the safe unpickler") as err:  # one line, not a missing file
        hfmodels.load_causal_lm(str(model_dir), pad_id=0)
    assert "\n" not in str(err.value) and "weights_only=False" not in str(err.value)
    assert not target.exists()
    torch.load(model_dir / "pytorch_model.bin", weights_only=False)  # the control: unguarded, it runs
    assert target.exists()


# ------------------------------------------------------------------ the test suite's server

def listening_addresses(port: int) -> set[str]:
    """Every address that the process serving ``port`` (and its children) listens on."""
    psutil = pytest.importorskip("psutil")
    owners = {c.pid for c in psutil.net_connections(kind="inet") if c.laddr and c.laddr.port == port
              and c.status == psutil.CONN_LISTEN}
    assert len(owners) == 1, owners
    server = psutil.Process(owners.pop())
    found = set()
    for proc in [server, *server.children(recursive=True)]:
        try:
            found |= {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:  # a child (a kernel shutting down) that exited since it was listed listens on nothing
            if proc is server:
                raise
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


@pytest.mark.launch
def test_the_notebook_server_listens_on_localhost_only_and_needs_its_token(server):
    port = int(server.base_url.rstrip("/").rsplit(":", 1)[1])
    assert listening_addresses(port) == {"127.0.0.1"}
    url = f"{server.base_url}api/sessions"
    assert status_code(url, server.token) == 200
    assert status_code(url, None) == 403
    assert status_code(url, "0" * len(server.token)) == 403
