#!/usr/bin/env bash
# Runs DeepEP 2.x's own V2 test script (tests/elastic/test_ep.py of a DeepEP checkout you fetched;
# nothing of DeepEP is in this repository) against ep_comm's `deep_ep` (ElasticBuffer over
# ep_comm's Buffer, helpers from ep_comm/integrations/deep_ep_utils) on CPU gloo ranks. The script
# is copied to a scratch folder and edited only where a CPU forces it:
#   - device='cuda' -> device='cpu';
#   - torch.cuda.synchronize() -> pass (nothing runs asynchronously on the CPU).
# Sizes are shrunk by command-line options only. The full mode sweep (144 cases) runs with
# --skip-perf-test; the timing phase (bench_kineto, which reports wall time per call on the CPU)
# runs on the first case. --deterministic is not combined with --do-cpu-sync 0: the script then
# compares a [:num_recv_tokens] slice with an unsliced worst-case tensor (DeepEP pads those too).
#
#   tools/deep_ep_elastic_tests.sh /path/to/DeepEP [python]
set -euo pipefail
src=${1:?usage: $0 /path/to/DeepEP [python]}
py=${2:-python}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$src"/tests/elastic/test_ep.py "$work"/
sed -i "s/device='cuda'/device='cpu'/g; s/device=\"cuda\"/device=\"cpu\"/g; s/torch\.cuda\.synchronize()/pass/g" \
    "$work"/test_ep.py
export PYTHONPATH="$("$py" -m ep_comm.integrations.deep_ep path)${PYTHONPATH:+:$PYTHONPATH}"
export MASTER_ADDR=127.0.0.1 WORLD_SIZE=1 RANK=0
cd "$work"
run() {  # run PORT PROCESSES EXPERTS ARGS...
    local port=$1 procs=$2 experts=$3; shift 3
    echo "== test_ep.py --num-processes $procs --num-experts $experts $*"
    if ! MASTER_PORT=$port "$py" test_ep.py --num-processes "$procs" --num-tokens 32 --hidden 256 --num-topk 4 \
            --num-experts "$experts" "$@" > log 2>&1; then
        cat log >&2; echo "FAILED: test_ep.py --num-processes $procs $*" >&2; exit 1
    fi
    echo "   $(grep -c 'Testing with' log) mode cases passed"
}
run 29721 2 8 --skip-perf-test
run 29722 2 8 --test-first-only
run 29723 2 8 --skip-perf-test --deterministic --unbalanced-ratio 2.0
run 29724 2 8 --skip-perf-test --do-cpu-sync 0 --masked-ratio 0.3 --allow-multiple-reduction 0
run 29725 2 8 --skip-perf-test --precise-unbalanced-ratio --unbalanced-ratio 1.5 --allow-hybrid-mode 0
run 29726 4 16 --skip-perf-test
run 29727 4 16 --test-first-only
run 29728 4 16 --skip-perf-test --do-cpu-sync 0 --masked-ratio 0.3 --allow-multiple-reduction 0
echo "DeepEP's V2 test script passed against ep_comm ($here)"
