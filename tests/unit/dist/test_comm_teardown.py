"""comm.teardown leaves the process group that comm.setup joined, and no other (issue 54: a
successful ``--rollout-engine vllm`` run in one plain process ended in a 20-line traceback, because
the trainer destroyed the group vLLM had made for itself before vLLM's own shutdown did)."""

import socket

import torch.distributed as dist

from gradnorm.dist import comm


def test_a_group_made_by_someone_else_survives_teardown(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # as vLLM does in one process
    try:
        ctx = comm.setup(device="cpu")  # one plain process: it joins nothing
        assert ctx.backend is None
        comm.teardown()
        assert dist.is_initialized()  # vLLM's group is still there for vLLM to destroy
    finally:
        dist.destroy_process_group()


def test_control_the_group_setup_joined_is_left(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    comm.setup(backend="gloo", device="cpu", timeout_s=30)
    assert dist.is_initialized()
    comm.teardown()
    assert not dist.is_initialized()
