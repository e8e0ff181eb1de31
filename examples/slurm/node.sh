#!/usr/bin/env bash
# One node's part of a gradnorm run under Slurm: train.sbatch starts this once per node with srun.
#
# It starts one torchrun agent with GPUS_PER_NODE workers. The agents meet at a c10d rendezvous on
# the job's first node (RDZV_HOST, exported by train.sbatch), keyed by the job id, so a requeued job
# meets again under the same id. --auto-resume makes every start the same command: the first one
# starts the run, an elastic restart (--max-restarts) or a requeue continues it from its latest
# complete checkpoint. Every argument is passed to gradnorm/train.py; --output-dir must be on a
# filesystem every node sees (checkpoints are written by every rank, read by every rank).
#
# A stop's checkpoint needs time: torchrun forwards SIGTERM to its workers and SIGKILLs them
# STOP_GRACE_S later (its --shutdown-timeout; 30 s if not given), so STOP_GRACE_S must cover a step
# plus its checkpoint and stay below the warning train.sbatch asks Slurm for (--signal=B:TERM@120).
# A torchrun without --shutdown-timeout (older torch) keeps its 30 s: said on stderr at start.
#
# tests/e2e/test_topology.py runs this file for two "nodes" on one host, with the variables srun sets.
set -euo pipefail
: "${SLURM_NNODES:?run under srun (train.sbatch)}" "${SLURM_NODEID:?}" "${SLURM_JOB_ID:?}" "${RDZV_HOST:?}"
cd "$(dirname "$0")/../.."
STOP_GRACE_S="${STOP_GRACE_S:-100}"
grace=(--shutdown-timeout="$STOP_GRACE_S")
if ! "${PYTHON:-python}" -m torch.distributed.run --help 2>/dev/null | grep -q -- --shutdown-timeout; then
    echo "node.sh: this torch's torchrun has no --shutdown-timeout: it SIGKILLs the workers 30 s after" \
        "a SIGTERM, so a stop's checkpoint must be written within 30 s" >&2
    grace=()
fi
exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes="$SLURM_NNODES" --node-rank="$SLURM_NODEID" --nproc_per_node="${GPUS_PER_NODE:-1}" \
    --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:${RDZV_PORT:-29500}" --rdzv-id="gradnorm-$SLURM_JOB_ID" \
    --max-restarts="${MAX_RESTARTS:-2}" "${grace[@]}" \
    gradnorm/train.py --auto-resume "$@"
