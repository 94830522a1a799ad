#!/usr/bin/env bash
# Produces the README's ep-bench figures: tables (.txt), reports (.json) and plots (.png).
#
#   bench/run_all.sh [OUT_DIR]          # default OUT_DIR: bench/results
#
# CPU runs (always): the default problem, every codec, skewed and group-limited routing, and the
# scale-out projection. GPU runs (only when nvidia-smi sees GPUs, or EP_BENCH_GPU=1): the same
# problem under torchrun over NCCL (--backend torch) and NVSHMEM (--backend nvshmem), one rank per
# GPU; the NVSHMEM run is skipped with a message when that backend is not built.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/results}"
mkdir -p "$OUT"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

run() {  # run NAME ARGS...: one ep-bench run, its table in NAME.txt, report NAME.json, plot NAME.png
  local name="$1"; shift
  echo "== ep-bench $* -> $OUT/$name.{txt,json,png}"
  local start=$SECONDS
  "$PY" -m ep_comm.bench "$@" --quiet --json "$OUT/$name.json" --plot "$OUT/$name.png" \
    | tee "$OUT/$name.txt"
  echo "(command: ep-bench $*; $((SECONDS - start)) s)" | tee -a "$OUT/$name.txt"
}

# 1. The quick-start: no options (4 CPU ranks, normal + low-latency, codec none).
run default
# 2. Codecs: what each one puts on the wire and what it costs on this machine.
run codecs --codec none,fp8,lossless,auto
# 3. Routing: skewed expert popularity, DeepSeek-V3's group-limited top-k.
run zipf --routing zipf --mode normal
run group_limited --routing group-limited --mode normal
# 4. Scale-out projection from the measured wire bytes (EP 8..256, NVLink 450 GB/s, RDMA 400 Gb/s).
run scaleout --simulate

# 5. GPU runs (hook for bench/gpu_check.sh and lent GPU machines).
if [ "${EP_BENCH_GPU:-0}" = 1 ] || { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
  NGPU="${NGPU:-$(nvidia-smi -L | wc -l)}"
  TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU")
  for backend in torch nvshmem; do
    # prefill-sized normal mode (DeepEP's 4096 tokens) and decode-sized low-latency mode
    for mode in normal:4096 low-latency:128; do
      name="gpu_${backend}_${mode%%:*}"
      echo "== torchrun x$NGPU ep-bench --backend $backend --mode ${mode%%:*} --tokens ${mode##*:}"
      "${TORCHRUN[@]}" -m ep_comm.bench --launcher torchrun --backend "$backend" --quiet \
        --mode "${mode%%:*}" --tokens "${mode##*:}" --codec none,fp8 --check \
        --json "$OUT/$name.json" --plot "$OUT/$name.png" | tee "$OUT/$name.txt" \
        || echo "ep-bench --backend $backend failed (see above)" | tee -a "$OUT/$name.txt"
    done
  done
fi
echo "results in $OUT"
