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
# tests/e2e/test_topology.py runs this file for two "nodes" on one host, with the variables srun sets.
set -euo pipefail
: "${SLURM_NNODES:?run under srun (train.sbatch)}" "${SLURM_NODEID:?}" "${SLURM_JOB_ID:?}" "${RDZV_HOST:?}"
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes="$SLURM_NNODES" --node-rank="$SLURM_NODEID" --nproc_per_node="${GPUS_PER_NODE:-1}" \
    --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:${RDZV_PORT:-29500}" --rdzv-id="gradnorm-$SLURM_JOB_ID" \
    --max-restarts="${MAX_RESTARTS:-2}" \
    gradnorm/train.py --auto-resume "$@"
