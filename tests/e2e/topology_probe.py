"""What one torchrun worker sees of its topology, as the trainer derives it (run by tests/e2e/test_topology.py).

    torchrun ... tests/e2e/topology_probe.py OUT_DIR

writes OUT_DIR/rank{RANK}.json: the launch variables and the trainer's own readings of them (the
device a CUDA run would take, the ranks sharing this host's memory), without joining a process
group, so that a probe of any topology runs on CPUs in a second.
"""

import json
import os
import sys
from pathlib import Path

from gradnorm.dist import comm
from gradnorm.trainer.guards import launch

if __name__ == "__main__":
    rank, world_size = launch.launch_environment()
    cuda = comm.local_device("cuda")  # the GPU this rank would train on (a torch.device needs no GPU)
    seen = {"rank": rank, "world_size": world_size, "local_rank": int(os.environ["LOCAL_RANK"]),
            "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "node_rank": int(os.environ["GROUP_RANK"]),
            "cuda_device": cuda.index, "sharing_host_memory": launch.local_ranks()}
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(seen) + "\n")
