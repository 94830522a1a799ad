#!/usr/bin/env bash
# Runs DeepEP's own V1 test scripts (tests/legacy/test_{intranode,low_latency,internode}.py of a
# DeepEP checkout you fetched; nothing of DeepEP is in this repository) against ep_comm's
# `deep_ep` on CPU gloo ranks. The scripts are copied to a scratch folder and edited only where a
# CPU forces it:
#   - device='cuda' -> device='cpu';
#   - the low-latency script's all_gather_into_tensor into a [R, N, K] tensor gets a [R*N, K] view
#     of the same tensor (gloo gathers into flat tensors only);
#   - the 8192 x 8192 fp32 GEMMs that stand in for expert work while a receive hook is pending
#     become 256 x 256 (timing only: the checks are untouched).
# deep_ep.utils.envs.init_dist picks gloo without CUDA, so nothing else changes.
#
#   tools/deep_ep_legacy_tests.sh /path/to/DeepEP [python]
# Internode runs as 2 virtual nodes of 8 ranks (16 processes): slow on a small machine.
set -euo pipefail
src=${1:?usage: $0 /path/to/DeepEP [python]}
py=${2:-python}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$src"/tests/legacy/test_*.py "$work"/
sed -i "s/device='cuda'/device='cpu'/g; s/device=\"cuda\"/device=\"cpu\"/g" "$work"/*.py
sed -i 's/dist.all_gather_into_tensor(all_topk_idx, topk_idx, group=group)/dist.all_gather_into_tensor(all_topk_idx.view(-1, *topk_idx.shape[1:]), topk_idx, group=group)/' "$work"/test_low_latency.py
sed -i 's/(8192, 8192)/(256, 256)/g' "$work"/*.py
export PYTHONPATH="$("$py" -m ep_comm.integrations.deep_ep path)${PYTHONPATH:+:$PYTHONPATH}"
export MASTER_ADDR=127.0.0.1
cd "$work"
run() {  # run NAME PORT NODES ARGS...
    local name=$1 port=$2 nodes=$3; shift 3
    echo "== $name $*"
    local pids=()
    for ((node = 0; node < nodes; node++)); do
        MASTER_PORT=$port WORLD_SIZE=$nodes RANK=$node "$py" "$name" "$@" > "$name.$node.log" 2>&1 &
        pids+=($!)
    done
    local rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    grep -v -i "warning\|return func\|bench_kineto(" "$name.0.log" | tail -4
    if [ $rc -ne 0 ]; then cat "$name".*.log >&2; echo "FAILED: $name $*" >&2; exit 1; fi
}
run test_intranode.py 29701 1 --num-processes 2 --num-tokens 64 --hidden 256 --num-topk 4 --num-experts 8
run test_intranode.py 29702 1 --num-processes 4 --num-tokens 48 --hidden 256 --num-topk 4 --num-experts 16
run test_low_latency.py 29703 1 --num-processes 2 --num-tokens 16 --hidden 512 --num-topk 4 --num-experts 8
run test_low_latency.py 29704 1 --num-processes 4 --num-tokens 16 --hidden 512 --num-topk 4 --num-experts 16 --use-logfmt
run test_internode.py 29705 2 --num-processes 8 --num-tokens 32 --hidden 256 --num-topk 4 --num-experts 32
echo "all DeepEP legacy scripts passed against ep_comm ($here)"
