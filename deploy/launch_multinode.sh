#!/usr/bin/env bash
# Start the trainer on this node of a multi-node job: one torchrun per node, rendezvous over c10d.
#
#   MASTER_ADDR=node0 NNODES=4 NODE_RANK=2 deploy/launch_multinode.sh --config configs/presets/sd3_grpo_ocr.yaml parallel.backend=fsdp2
#   deploy/launch_multinode.sh --dry-run ...      # print the torchrun command line instead of running it
#
# Environment (SLURM's is used when present, see deploy/slurm.sbatch):
#   NNODES          nodes in the job            (default: SLURM_NNODES, else 1)
#   NODE_RANK       this node's index            (default: SLURM_NODEID, else 0)
#   NPROC_PER_NODE  processes (GPUs) per node    (default: the GPUs CUDA_VISIBLE_DEVICES lists, else
#                                                 SLURM_GPUS_ON_NODE, else nvidia-smi -L's count, else 1)
#   MASTER_ADDR     host of the rendezvous       (required with more than one node)
#   MASTER_PORT     port of the rendezvous       (default: 29500)
#   RDZV_ID         job id shared by all nodes   (default: SLURM_JOB_ID, else "rewardflow")
# Arguments after the options go to trainer/main.py unchanged.
set -euo pipefail

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
  dry_run=1
  shift
fi

nnodes="${NNODES:-${SLURM_NNODES:-1}}"
node_rank="${NODE_RANK:-${SLURM_NODEID:-0}}"
if [[ -n "${NPROC_PER_NODE:-}" ]]; then
  nproc="$NPROC_PER_NODE" nproc_from="NPROC_PER_NODE"
elif [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
  nproc="$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c '[^[:space:]]' || true)"
  nproc_from="CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
  nproc="$SLURM_GPUS_ON_NODE" nproc_from="SLURM_GPUS_ON_NODE"
elif command -v nvidia-smi >/dev/null 2>&1; then
  if ! gpus="$(nvidia-smi -L 2>&1)"; then
    echo "error: 'nvidia-smi -L' failed: $gpus" >&2
    echo "set NPROC_PER_NODE (or CUDA_VISIBLE_DEVICES) to say how many processes (GPUs) to start on this node" >&2
    exit 2
  fi
  nproc="$(grep -c '^GPU ' <<<"$gpus" || true)" nproc_from="the GPUs 'nvidia-smi -L' lists"
else
  nproc=1 nproc_from="no nvidia-smi: one process"
fi
if ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: $nproc_from gives '$nproc' processes per node; set NPROC_PER_NODE to a positive number" >&2
  exit 2
fi
echo "launch_multinode.sh: $nproc process(es) on this node (from $nproc_from)" >&2
port="${MASTER_PORT:-29500}"
rdzv_id="${RDZV_ID:-${SLURM_JOB_ID:-rewardflow}}"
if [[ "$nnodes" -gt 1 && -z "${MASTER_ADDR:-}" ]]; then
  echo "error: MASTER_ADDR must name the rendezvous host when NNODES=$nnodes > 1" >&2
  exit 2
fi
addr="${MASTER_ADDR:-127.0.0.1}"

cd "$(dirname "$0")/.."
cmd=(torchrun --nnodes="$nnodes" --node_rank="$node_rank" --nproc_per_node="$nproc"
     --rdzv_backend=c10d --rdzv_endpoint="$addr:$port" --rdzv_id="$rdzv_id"
     trainer/main.py "$@")
# SIGUSR1 (SLURM's warning before the time limit, passed on by deploy/slurm.sbatch) is for the trainer's ranks
# alone: they stop gracefully after their step with a checkpoint (trainer/stopping.py). Ignored here, it stays
# ignored in torchrun, which would otherwise die of it, and in the reward replicas; the ranks install their own handler.
trap '' USR1
if [[ "$dry_run" == 1 ]]; then
  printf '%q ' "${cmd[@]}"
  echo
else
  exec "${cmd[@]}"
fi
