#!/bin/bash
# Train the course GPT on 2 nodes with Slurm: one torchrun agent per node, every agent
# starting 4 ranks, 8 ranks in all on a dp=2 x pp=2 x tp=2 mesh.
#
#   sbatch examples/slurm_train.sh                 # submit
#   CKPT=/shared/me/run1 sbatch examples/slurm_train.sh
#
# The job checkpoints every 50 steps into $CKPT and always continues from the latest
# checkpoint there (minipar.train does that by itself), on whatever mesh this script asks
# for. The checkpoint directory must be on a file system every node sees (NFS, Lustre,
# GPFS): each rank writes its own file there and rank 0 commits the checkpoint.
#
# Surviving failures:
# * A rank dies (killed, out of memory, a node reboots): torchrun --max-restarts starts
#   every rank again and training continues from the latest checkpoint.
# * A rank hangs: with no progress for --hang-timeout seconds every rank stops (exit 124),
#   printing the collective each rank last started; torchrun restarts them.
# * Preemption and the time limit: Slurm sends SIGTERM to every process of the job
#   before it kills them (after KillWait, 30 s by default), and SIGUSR1 120 s before the
#   time limit (--signal below). torchrun passes both on to the ranks (--signals-to-handle;
#   on torch releases without that flag: export TORCHELASTIC_SIGNALS_TO_HANDLE=...);
#   minipar.train finishes the step in flight, saves a checkpoint and exits with code 75
#   (EX_TEMPFAIL: "try again"), writing "reason": "preempted" into --out. This script
#   then requeues the job (--requeue), and the next run continues at the next step.
#
#SBATCH --job-name=minipar-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun agent per node; it starts the ranks
#SBATCH --cpus-per-task=8            # CPU ranks over Gloo; on GPU nodes add --gpus-per-node=4 and --device cuda
#SBATCH --time=00:30:00
#SBATCH --signal=USR1@120            # SIGUSR1 to the job's processes 120 s before the time limit
#SBATCH --requeue                    # the job may run again (after a preemption, or requeued below)
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

mkdir -p "$CKPT"
rm -f "$CKPT/last_run.json"
status=0
srun --kill-on-bad-exit=1 python -m torch.distributed.run \
    --nnodes "$SLURM_NNODES" \
    --nproc_per_node "$RANKS_PER_NODE" \
    --max-restarts 3 \
    --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    --rdzv_backend c10d \
    --rdzv_endpoint "$HEAD:$PORT" \
    --rdzv_id "$SLURM_JOB_ID" \
    -m minipar.train \
        --dp 2 --pp 2 --tp 2 --microbatches 2 \
        --steps 1000 --save-every 50 --keep 2 \
        --hang-timeout 300 \
        --checkpoint-dir "$CKPT" \
        --out "$CKPT/last_run.json" || status=$?

# torchrun reports the ranks' exit code 75 as a failure of its own; the --out file says why
if grep -q '"reason": "preempted"' "$CKPT/last_run.json" 2>/dev/null; then
    echo "checkpointed after a stop signal: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"
