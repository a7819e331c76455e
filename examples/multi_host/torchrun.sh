#!/usr/bin/env bash
# Start a job on several hosts with torchrun: run this on every host, from the same folder of a filesystem that every
# host shares (the run folder and the sharded checkpoint are written there by every rank).
#
#   HEAD=node01 HOSTS=2 RANKS_PER_HOST=4 JOB_ID=gpt-june ./torchrun.sh -m lightning_mics.app.train \
#       strategy.sharded_data_parallel_degree=4                       # the main job: outputs/torchrun-gpt-june/
#   HEAD=node01 HOSTS=2 RANKS_PER_HOST=4 JOB_ID=gpt-june ./torchrun.sh examples/multi_host/trainer_script.py \
#       --shard 4                                                     # a Trainer script: runs/torchrun-gpt-june/
#
# HEAD: the first host's name or address (torchrun's c10d rendezvous runs there, on PORT); JOB_ID: the job's id, the
# same on every host and new for every job (it names the run folder). LOCAL_ADDR: this host's address, where the
# hosts share one hostname (containers, network namespaces). TORCHRUN: the launcher command (default torchrun).
set -euo pipefail
: "${HEAD:?HEAD=<the first host>}" "${HOSTS:?HOSTS=<number of hosts>}" "${JOB_ID:?JOB_ID=<the job id>}"
RANKS_PER_HOST=${RANKS_PER_HOST:-1}
# Each rank gets this host's cores / its ranks, as Lightning's own launcher gives them. (torchrun would set
# OMP_NUM_THREADS=1 when it starts several ranks per host; with one rank per host the strategy sets the threads.)
if [ -z "${OMP_NUM_THREADS:-}" ] && [ "$RANKS_PER_HOST" -gt 1 ]; then
  export OMP_NUM_THREADS=$(( $(nproc) / RANKS_PER_HOST > 0 ? $(nproc) / RANKS_PER_HOST : 1 ))
fi
exec ${TORCHRUN:-torchrun} --nnodes "$HOSTS" --nproc-per-node "$RANKS_PER_HOST" \
  --rdzv-backend c10d --rdzv-endpoint "$HEAD:${PORT:-29500}" --rdzv-id "$JOB_ID" \
  ${LOCAL_ADDR:+--local-addr "$LOCAL_ADDR"} "$@"
