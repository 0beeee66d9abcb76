#!/bin/bash
# Train the course GPT on 2 nodes with Slurm: one torchrun agent per node, every agent
# starting 4 ranks, 8 ranks in all on a dp=2 x pp=2 x tp=2 mesh.
#
#   sbatch examples/slurm_train.sh                 # submit
#   CKPT=/shared/me/run1 sbatch examples/slurm_train.sh
#
# The job checkpoints every 50 steps and starts with --resume, so a preempted or
# requeued job (or a second sbatch of the same script) continues where the last
# checkpoint left off, on whatever mesh this script asks for. The checkpoint directory
# must be on a file system every node sees (NFS, Lustre, GPFS): each rank writes its own
# file there and rank 0 commits the checkpoint.
#
#SBATCH --job-name=minipar-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun agent per node; it starts the ranks
#SBATCH --cpus-per-task=8            # minipar computes on CPU tensors with Gloo
#SBATCH --time=00:30:00
#SBATCH --requeue                    # after a preemption, Slurm runs the job again
#SBATCH --open-mode=append           # ... and appends to the same log
#SBATCH --output=%x-%j.out

set -euo pipefail

RANKS_PER_NODE=${RANKS_PER_NODE:-4}
CKPT=${CKPT:-$PWD/checkpoints/$SLURM_JOB_NAME}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)  # rendezvous host
PORT=${PORT:-29500}

export OMP_NUM_THREADS=$(( SLURM_CPUS_PER_TASK / RANKS_PER_NODE ))
# Gloo (and NCCL) pick a network interface from the host name; on clusters with several
# networks name the fast one, e.g. ib0 or eth0:
# export GLOO_SOCKET_IFNAME=ib0 NCCL_SOCKET_IFNAME=ib0

srun --kill-on-bad-exit=1 python -m torch.distributed.run \
    --nnodes "$SLURM_NNODES" \
    --nproc_per_node "$RANKS_PER_NODE" \
    --rdzv_backend c10d \
    --rdzv_endpoint "$HEAD:$PORT" \
    --rdzv_id "$SLURM_JOB_ID" \
    -m minipar.train \
        --dp 2 --pp 2 --tp 2 --microbatches 2 \
        --steps 1000 --save-every 50 --keep 2 \
        --checkpoint-dir "$CKPT" --resume \
        --out "$CKPT/last_run.json"
