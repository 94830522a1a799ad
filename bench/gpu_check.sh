#!/usr/bin/env bash
# Every GPU test and GPU benchmark of ep_comm, in one run that fits a short device lease (< 5 min
# on one H200). From the repository root:
#
#   bench/gpu_check.sh            # OUT=dir for the logs (default bench/out), PYTHON=... to pick python
#   bench/gpu_check.sh codec      # only the codec steps (1 without the CUDA build, and 2)
#   bench/gpu_check.sh kernels    # every step but the codec ones (2-4): a second command of a lease
#
# Order (most wanted first; each step has its own time limit, a failing step does not stop the rest,
# and the whole run keeps to DEADLINE seconds, default 540, under the device tool's 600 s per
# command: a step gets at most the time left, and a step that would get under 20 s is skipped):
#   1. the host codec build (g++), then in the background the CUDA extension build;
#   2. meanwhile the lossless codec kernels (default build): GPU tests (byte identity with the
#      host encoder, corruption statuses) and bench/codec_gpu.py (throughput vs the device copy);
#   3. the codecs through the public API on CUDA tensors (never run on a GPU yet): their tests
#      and bench/codec_device_api.py (needs the CUDA build);
#   4. the decoder variants prepared by gpu_prepare.sh: a subset of the GPU tests (CI runs them all
#      on every variant through the CUDA emulation) and throughput, registers logged;
#   5. low-latency dispatch/combine captured in a CUDA graph and replayed (tests/gpu/test_low_latency_graph.py),
#      the Triton row kernels and the portable backend (bench/triton_rows.py, bench/portable_gpu.py),
#      then the other GPU tests (intranode/low-latency/two-hop kernels, NVSHMEM, CUDA IPC), and
#      bench/ipc_bench.py (two processes: the ring and direct copies' call time vs kernel time);
#   6. bench/gpu_bench.py (dispatch/combine bandwidth vs the device copy, 8 and 16 channels, the ring
#      and the direct-write intranode kernels: its JSON line names the faster as "normal_copy");
#   7. ncu: DRAM bytes per payload byte of the intranode kernels (ring, then direct writes), then the
#      codec kernels' profile.
# Prepared pieces in .gpu_carry/ (made by bench/gpu_prepare.sh on a machine without a GPU) are used
# when they match: real tensors for the codec benchmark, the codec kernel library, and the CUDA
# objects (only when csrc/ and the NVSHMEM wheel's version are those they were built from).
set -u
cd "$(dirname "$0")/.."
case "${1:-all}" in all | codec | kernels) ;; *) echo "usage: bench/gpu_check.sh [codec | kernels]" >&2; exit 2 ;; esac
start=$(date +%s)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/out}
CARRY=.gpu_carry
mkdir -p "$OUT"
LOG="$OUT/log.txt"
say() { echo "== [$(( $(date +%s) - start )) s] $*" | tee -a "$LOG"; }
csrc_hash() { find csrc -type f | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16; }

DEADLINE=${DEADLINE:-540}
# step NAME SECONDS: announces a step and sets T to its time limit (SECONDS, or the time left
# before DEADLINE when less); returns 1 (step skipped) when under 20 s would be left
step() {
  local left=$(( DEADLINE - ($(date +%s) - start) ))
  T=$(( $2 < left ? $2 : left ))
  if [ $T -lt 20 ]; then say "SKIPPED (${left} s left before the ${DEADLINE} s deadline): $1"; return 1; fi
  say "$1 (limit ${T} s)"
}

say "environment"
{
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  timeout 60 $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available())'
  timeout 30 $PY -m pip list 2>/dev/null | grep -iE "^(nvidia-nvshmem|cuda-bindings|cuda-python|pybind11|pytest|hypothesis|rich|numpy) "
  timeout 20 $CUDA_HOME/bin/nvcc --version | tail -2
  timeout 20 $PY -c 'import sysconfig, os; p = sysconfig.get_paths()["include"]; print("Python.h:", os.path.exists(p + "/Python.h"), p)'
} 2>&1 | tee -a "$LOG"

if step "host build (EP_COMM_CUDA=0)" 90; then
  EP_COMM_CUDA=0 timeout $T $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; say "HOST BUILD FAILED"; }
fi

# CUDA objects prepared elsewhere: only when the sources and NVSHMEM's version match
nvshmem_version=$($PY -m pip show nvidia-nvshmem-cu13 2>/dev/null | sed -n 's/^Version: //p')
temp=build/$($PY -c 'import sys, sysconfig; print(f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")')/ep_comm_cuda
prepared=0; [ "$(cat $CARRY/csrc_hash 2>/dev/null)" = "$(csrc_hash)" ] && prepared=1
if [ -d $CARRY/ep_comm_cuda ] && [ "$(cat $CARRY/nvshmem_version 2>/dev/null)" = "$nvshmem_version" ] && [ $prepared = 1 ]; then
  mkdir -p "$temp" && cp $CARRY/ep_comm_cuda/*.o "$temp/" && touch -d "@$(date +%s)" "$temp"/*.o
  say "using the prepared CUDA objects (NVSHMEM $nvshmem_version)"
else
  say "building every CUDA object here (NVSHMEM here: $nvshmem_version; prepared csrc hash matches: $prepared)"
fi
ONLY=${1:-all}
if [ "$ONLY" = codec ]; then build_pid=""; else
  say "CUDA build in the background"
  ( EP_COMM_CUDA=1 timeout 240 $PY setup.py build_ext --inplace >> "$OUT/build.log" 2>&1; echo $? > "$OUT/.cuda_build_rc" ) &
  build_pid=$!
fi

# the codec kernel libraries: the prepared default build and its variants (or one built here)
libs=""; [ $prepared = 1 ] && libs=$(ls $PWD/$CARRY/libep_codec*.so 2>/dev/null)
lib=""; [ -f $CARRY/libep_codec.so ] && [ -n "$libs" ] && lib=$PWD/$CARRY/libep_codec.so
codec_tests() {  # $1: library ("" = build one here); $2: optional pytest -k expression
  EP_COMM_CODEC_GPU_LIB=$1 timeout $T $PY -m pytest -q -p no:cacheprovider tests/gpu/test_codec_lossless_gpu.py \
    -rfE -x --maxfail=3 ${2:+-k "$2"} >> "$OUT/codec_tests.log" 2>&1
  say "codec tests ${1##*/} rc=$?: $(tail -1 "$OUT/codec_tests.log")"
}
want() { [ "$ONLY" = all ] || [ "$ONLY" = "$1" ]; }  # a step of the part ONLY names
if want codec && step "lossless codec: GPU tests (default build)" 90; then codec_tests "$lib"; fi
if ! want codec; then :
elif [ -f $CARRY/tensors.pt ]; then
  if step "lossless codec: GPU throughput (default build)" 100; then
    timeout $T $PY bench/codec_gpu.py --tensors $CARRY/tensors.pt ${lib:+--lib $lib} --chunk-values 65536,8192 \
      --json "$OUT/codec_gpu.json" >> "$LOG" 2>&1
    say "codec bench rc=$?"
  fi
  if step "lossless codec: one 64x7168 message's latency per chunk size (target < 20 us each)" 40; then
    timeout $T $PY bench/codec_gpu.py --tensors $CARRY/tensors.pt ${lib:+--lib $lib} --message \
      --chunk-values 65536,16384,4096,2048 --reps 50 --json "$OUT/codec_message.json" >> "$LOG" 2>&1
    say "codec message latency rc=$?"
  fi
else
  say "no $CARRY/tensors.pt (bench/gpu_prepare.sh makes it): codec throughput skipped"
fi

if [ "$ONLY" != codec ]; then
  say "waiting for the CUDA build"
  wait $build_pid
  say "CUDA build rc=$(cat "$OUT/.cuda_build_rc" 2>/dev/null) ($(grep -c 'bin/nvcc ' "$OUT/build.log") nvcc runs)"
  timeout 60 $PY -c "import json, ep_comm._build as b; print(json.dumps(b.build_info()))" >> "$LOG" 2>&1 || tail -30 "$OUT/build.log" >> "$LOG"
  export EP_COMM_GPU_REPORT="$OUT/report.txt"; rm -f "$EP_COMM_GPU_REPORT"
  per_test=""; $PY -c "import pytest_timeout" 2>/dev/null && per_test="--timeout 100"
  if want codec && step "codecs through the public API on CUDA tensors: tests" 90; then
    timeout $T $PY -m pytest -q -p no:cacheprovider tests/gpu/test_codecs_device.py -rA $per_test \
      > "$OUT/codecs_device_tests.log" 2>&1
    say "codecs device tests rc=$?: $(tail -1 "$OUT/codecs_device_tests.log")"
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$OUT/codecs_device_tests.log" | cut -c1-300 >> "$LOG"
  fi
  if want codec && step "codecs through the public API on CUDA tensors: per-message cost" 60; then
    tensors_arg=""; [ -f $CARRY/tensors.pt ] && tensors_arg="--tensors $CARRY/tensors.pt"
    timeout $T $PY bench/codec_device_api.py $tensors_arg --json "$OUT/codec_device_api.json" \
      > "$OUT/codec_device_api.log" 2>&1
    say "codec_device_api rc=$?"
    cut -c1-300 "$OUT/codec_device_api.log" >> "$LOG"
  fi
fi

# decoder variants: registers and spills as ptxas reported them (gpu_prepare.sh), tests, throughput
if want codec && [ "$(echo $libs | wc -w)" -gt 1 ]; then
  cat $CARRY/*.ptxas.txt >> "$LOG" 2>/dev/null
  # every variant's logic is tested in CI through the CUDA emulation (tests/test_codec_kernels_emulated.py):
  # here a subset per variant (the real device's memory and scheduling), to leave time for throughput
  for l in $libs; do
    [ "$l" = "$lib" ] && continue
    if step "codec tests, variant ${l##*/}" 30; then codec_tests "$l" "normal or sparse or wide_exponents or corrupted"; fi
  done
  if [ -f $CARRY/tensors.pt ] && step "codec throughput, every build" 150; then
    timeout $T $PY bench/codec_gpu.py --tensors $CARRY/tensors.pt $(for l in $libs; do echo --lib $l; done) \
      --kinds activations,gradients --chunk-values 65536 >> "$LOG" 2>&1
    say "codec variants rc=$?"
  fi
fi
if [ "$ONLY" = codec ]; then say "done (codec only)"; exit 0; fi

# low-latency calls on the kernel path captured in a CUDA graph (dispatch + hook + combine, bf16 and
# FP8; one PE, then two processes on GPU 0), replayed with new inputs against the reference
if step "low-latency dispatch/combine: CUDA graph capture and replay" 120; then
  timeout $T $PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_low_latency_graph.py -rA $per_test \
    > "$OUT/ll_graph.log" 2>&1
  say "low-latency graph capture rc=$?: $(tail -1 "$OUT/ll_graph.log")"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|replay|status|fused|Error" "$OUT/ll_graph.log" | cut -c1-300 >> "$LOG"
fi

# Triton row kernels of the portable path (ep_comm/row_kernels; Triton only, no CUDA build needed):
# every result bit-exact against the CPU reference, and GB/s against the device copy
if step "Triton row kernels: bit-exactness and GB/s vs the device copy" 120; then
  timeout $T $PY bench/triton_rows.py --json "$OUT/triton_rows.json" > "$OUT/triton_rows.log" 2>&1
  say "triton_rows rc=$?"
  cut -c1-400 "$OUT/triton_rows.log" >> "$LOG"
fi

# the portable backend on the GPU (no CUDA build needed): a one-rank NCCL Buffer(backend="torch")
# and 2 and 4 gloo ranks on CUDA tensors (host-staged, pinned, chunked), each against the CPU
# reference; dispatch + combine against a bare all_to_all_single of the same bytes (ratio, target
# <= 1.3); the staged exchange in 4 MiB chunks against one chunk per message (overlap_speedup)
if step "portable backend on the GPU: NCCL one rank, gloo ranks on CUDA tensors, vs bare all-to-all" 60; then
  timeout $T $PY bench/portable_gpu.py --iters 5 --staged-mb 64 --json "$OUT/portable_gpu.json" \
    > "$OUT/portable_gpu.log" 2>&1
  say "portable_gpu rc=$?"
  cut -c1-600 "$OUT/portable_gpu.log" >> "$LOG"
fi

if step "other GPU tests" 170; then
  timeout $T $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu --ignore tests/gpu/test_codec_lossless_gpu.py \
    --ignore tests/gpu/test_codecs_device.py --ignore tests/gpu/test_low_latency_graph.py -rA $per_test \
    > "$OUT/gpu_tests.log" 2>&1
  say "GPU tests rc=$?: $(tail -1 "$OUT/gpu_tests.log")"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$OUT/gpu_tests.log" | cut -c1-300 >> "$LOG"
fi

# two processes over CUDA IPC: each copy's call time against its kernel time (the direct copy's
# per-call handle exchange and closing barrier), and whether both copies received the same rows
if step "intranode engine between processes: per-call cost of the ring and direct copies" 60; then
  EP_IPC_BENCH_LIMIT_S=$((T - 5)) timeout $T $PY bench/ipc_bench.py --ranks 2 --tokens 1024 >> "$OUT/ipc_bench.log" 2>&1
  say "ipc_bench rc=$?"
  tail -1 "$OUT/ipc_bench.log" | cut -c1-2000 >> "$LOG"
fi

for channels in 8 16; do  # intranode channels: 2 * channels * 8 blocks must be resident at once (2 per SM: 264 on an H200)
  # ring and direct, each with 1 and 2 warps per peer (ring_w2: 512-thread blocks, refused where the grid
  # cannot be resident at once: reported under "refused")
  if step "dispatch/combine benchmark, $channels channels" 60; then
    timeout $T $PY bench/gpu_bench.py --channels $channels --ring-warps 1,2 --direct-warps 1,2 >> "$OUT/gpu_bench.log" 2>&1
    say "gpu_bench --channels $channels rc=$?"
    tail -1 "$OUT/gpu_bench.log" | cut -c1-2000 >> "$LOG"
  fi
done

# DRAM traffic of the intranode kernels per payload byte: ncu's dram__bytes_read/write of one
# dispatch and one combine launch (after a warm-up call each) against the JSON line's "bytes"
# (payload bytes received); a ring costs about 3-3.5 bytes per payload byte, a direct write about 2
if [ "${EP_GPU_NCU:-1}" = 1 ]; then command -v ncu > /dev/null || say "no ncu on PATH: DRAM bytes per payload byte not measured"; fi
for copy in ring direct; do
  if [ "${EP_GPU_NCU:-1}" = 1 ] && command -v ncu > /dev/null && step "ncu DRAM bytes of the intranode kernels ($copy)" 60; then
    timeout $T ncu --clock-control none -k regex:"dispatch(_direct)?_kernel|combine(_direct)?_kernel_(bf16|f32)" \
      --launch-skip 2 --launch-count 2 --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
      $PY bench/gpu_bench.py --channels 8 --iters 1 --no-low-latency --copy $copy --direct-warps 1 \
      > "$OUT/ncu_intranode_$copy.log" 2>&1
    say "ncu intranode $copy rc=$?"
    grep -E "dispatch.*kernel|combine.*kernel|dram__bytes|gpu__time|^\{" "$OUT/ncu_intranode_$copy.log" | cut -c1-300 >> "$LOG"
  fi
done

if want codec && [ "${EP_GPU_NCU:-1}" = 1 ] && command -v ncu > /dev/null && [ -f $CARRY/tensors.pt ] && step "ncu profile of the codec kernels" 120; then
  timeout $T ncu --clock-control none -k regex:"histogram_kernel|rans_kernel|layout_kernel|decode_kernel" \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    $PY bench/codec_gpu.py --tensors $CARRY/tensors.pt ${lib:+--lib $lib} --once --gpu-mb 256 \
    > "$OUT/ncu.log" 2>&1
  say "ncu rc=$?"
fi
rm -f "$OUT/.cuda_build_rc"
say "done"
