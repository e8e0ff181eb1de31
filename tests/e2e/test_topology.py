"""Two nodes are two torchrun agents: 2 agents x 1 worker train exactly as 1 agent x 2 workers.

What must hold (slow; docs/scale.md states it as what was run):
- the same run launched as two "nodes" on this host by examples/slurm/node.sh, the per-node
  command of examples/slurm/train.sbatch, under the variables srun sets (SLURM_NNODES,
  SLURM_NODEID, SLURM_JOB_ID; a c10d rendezvous on the first node), and as one agent with two
  workers, logs the same step-1 rollout digest, loss and gradient norm, bit for bit, and every
  metrics.jsonl step once (only global rank 0 writes the run's records: a rank that took
  LOCAL_RANK 0 for the main one would write them twice); the requeue of the finished job, the
  same commands again, exits 0 with nothing to do;
- ranks started with different flags (a node launched with another command line) all refuse in one
  line, every node's log says so, nothing of a run is written; the same flags pass;
- each worker reads its topology as a multi-node run needs: the device from LOCAL_RANK, never RANK
  (rank 1 on node 1 takes GPU 0), the ranks sharing its host's memory from LOCAL_WORLD_SIZE.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from tests.helpers.runfiles import launch_all, metrics
from tests.helpers.trainer import tiny, torchrun_cmd

from gradnorm.dist.spawn import free_port
from gradnorm.teach.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FLAGS = tiny(steps="2", save_every="0")  # TINY, 2 steps to compare across topologies, no checkpoint
PROBE = Path(__file__).with_name("topology_probe.py")


def slurm_nodes(job_id: str, *args: str) -> list[tuple[list[str], dict]]:
    """examples/slurm/node.sh for nodes 0 and 1 of a 2-node job, each with the environment srun gives it."""
    port = str(free_port())
    return [(["bash", "examples/slurm/node.sh", *args],
             {**ENV, "SLURM_NNODES": "2", "SLURM_NODEID": str(node), "SLURM_JOB_ID": job_id, "SLURM_PROCID": str(node),
              "SLURM_NTASKS": "2", "RDZV_HOST": "localhost", "RDZV_PORT": port, "GPUS_PER_NODE": "1",
              "PYTHON": sys.executable}) for node in (0, 1)]


def run_together(jobs: list[tuple[list[str], dict]], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Start every (command, environment) at once and wait for all: the nodes of one job."""
    logs = [tempfile.TemporaryFile("w+") for _ in jobs]  # not pipes: a full one would stall its node, and so both
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
             for (cmd, env), log in zip(jobs, logs)]
    codes = [p.wait(timeout) for p in procs]
    for log in logs:
        log.seek(0)
    return [subprocess.CompletedProcess(p.args, code, log.read()) for p, code, log in zip(procs, codes, logs)]


def two_nodes(script: str | Path, *args: str) -> list[list[str]]:
    """The command of each of two torchrun agents, one worker each, meeting at a c10d rendezvous."""
    port = free_port()
    return [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc_per_node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id=topology-{port}", str(script),
             *args] for node in (0, 1)]


def probes(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_two_nodes_of_one_worker_train_as_one_node_of_two(tmp_path):
    nodes, one = tmp_path / "two-nodes", tmp_path / "one-node"
    seen_nodes, seen_one = tmp_path / "probe-two-nodes", tmp_path / "probe-one-node"
    seen_nodes.mkdir(), seen_one.mkdir()
    for node in run_together(slurm_nodes("4242", *FLAGS, "--output-dir", str(nodes))):
        assert node.returncode == 0, node.stdout[-3000:]
    launch_all([torchrun_cmd(one, base=FLAGS),
                torchrun_command(2, str(seen_one), script=PROBE)], ROOT, ENV)
    launch_all(two_nodes(PROBE, str(seen_nodes)), ROOT, ENV)

    first = {name: metrics(out)[0] for name, out in (("nodes", nodes), ("one", one))}
    for key in ("rollout_digest", "loss", "grad_norm", "reward_mean", "tokens"):
        assert first["nodes"][key] == first["one"][key], key  # bit for bit
    assert [m["step"] for m in metrics(nodes)] == [1, 2]  # written once, by global rank 0
    assert json.loads((nodes / "config.json").read_text())["world_size"] == 2
    requeued = run_together(slurm_nodes("4242", *FLAGS, "--output-dir", str(nodes)))  # the job requeued at its end
    assert [node.returncode for node in requeued] == [0, 0]
    assert sum("is complete at step 2 (--steps 2): nothing to do" in node.stdout for node in requeued) == 1  # rank 0
    assert [m["step"] for m in metrics(nodes)] == [1, 2]

    assert [(p["rank"], p["node_rank"], p["local_rank"], p["local_world_size"]) for p in probes(seen_nodes)] == \
        [(0, 0, 0, 1), (1, 1, 0, 1)]
    assert [p["cuda_device"] for p in probes(seen_nodes)] == [0, 0]  # LOCAL_RANK, not RANK
    assert [p["sharing_host_memory"] for p in probes(seen_nodes)] == [1, 1]
    assert [(p["rank"], p["local_rank"], p["cuda_device"], p["sharing_host_memory"]) for p in probes(seen_one)] == \
        [(0, 0, 0, 2), (1, 1, 1, 2)]  # the control: on one node the two ranks take two GPUs and share RAM


@pytest.mark.slow
def test_a_node_started_with_other_flags_stops_both_nodes_with_one_line_each(tmp_path):
    out = tmp_path / "run"
    nodes = slurm_nodes("4343", *FLAGS, "--output-dir", str(out), "--timeout-s", "10")
    nodes[1][0].extend(["--lr", "1e-3"])  # node 1's command line differs
    for _, env in nodes:  # torchrun restarts on any failure, bad input too: each restart would say it again
        env["MAX_RESTARTS"] = "0"
    stopped = run_together(nodes, timeout=120)
    assert [node.returncode for node in stopped] == [1, 1]  # torchrun's code for a failed worker, whatever its own
    lines = []
    for node in stopped:
        errors = [line for line in node.stdout.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "the ranks were started with different flags" in errors[0], node.stdout[-3000:]
        lines += errors
    # The rendezvous, not --node-rank, decides which node holds rank 0: one line is rank 0's, the other rank 1's.
    assert sorted(line.startswith("error: rank 1: ") for line in lines) == [False, True], lines
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("ckpt_step*"))  # nothing of a run written


def _check_flags(ctx, lr_on_rank_1):
    from gradnorm.trainer.config import parse_config
    from gradnorm.trainer.guards import launch

    flags = ["--lr", lr_on_rank_1] if ctx.rank == 1 else []
    try:  # compared before rank 0 resolves --auto-resume, so every flag must be the same, --resume too
        launch.check_same_command(parse_config(flags))
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.launch
def test_ranks_started_with_different_flags_all_refuse_and_the_same_flags_pass():
    from gradnorm.dist.spawn import spawn_gloo

    says = spawn_gloo(_check_flags, 2, "1e-3")
    assert all(s and s.startswith("the ranks were started with different flags") for s in says), says
    assert spawn_gloo(_check_flags, 2, "5e-4") == [None, None]  # the control: --lr's default on both
