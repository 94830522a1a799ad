#!/usr/bin/env bash
# Every GPU test and GPU benchmark of ep_comm, in one run that fits a short device lease (< 5 min
# on one H200). From the repository root:
#
#   bench/gpu_check.sh            # OUT=dir for the logs (default bench/out), PYTHON=... to pick python
#   bench/gpu_check.sh codec      # only the codec steps (1 without the CUDA build, and 2)
#
# Order (most wanted first; each step has its own time limit, a failing step does not stop the rest):
#   1. the host codec build (g++), then in the background the CUDA extension build;
#   2. meanwhile the lossless codec kernels: GPU tests (byte identity with the host encoder,
#      corruption statuses) and bench/codec_gpu.py (throughput vs the device copy);
#   3. the other GPU tests (intranode/low-latency/two-hop kernels, NVSHMEM, CUDA IPC);
#   4. bench/gpu_bench.py (dispatch/combine bandwidth vs the device copy).
# Prepared pieces in .gpu_carry/ (made by bench/gpu_prepare.sh on a machine without a GPU) are used
# when they match: real tensors for the codec benchmark, the codec kernel library, and the CUDA
# objects (only when csrc/ and the NVSHMEM wheel's version are those they were built from).
set -u
cd "$(dirname "$0")/.."
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

say "environment"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available())'
  $PY -m pip list 2>/dev/null | grep -iE "^(nvidia-nvshmem|cuda-bindings|cuda-python|pybind11|pytest|hypothesis|rich|numpy) "
  $CUDA_HOME/bin/nvcc --version | tail -2
  $PY -c 'import sysconfig, os; p = sysconfig.get_paths()["include"]; print("Python.h:", os.path.exists(p + "/Python.h"), p)'
} 2>&1 | tee -a "$LOG"

say "host build (EP_COMM_CUDA=0)"
EP_COMM_CUDA=0 timeout 90 $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; say "HOST BUILD FAILED"; }

# CUDA objects prepared elsewhere: only when the sources and NVSHMEM's version match
nvshmem_version=$($PY -m pip show nvidia-nvshmem-cu13 2>/dev/null | sed -n 's/^Version: //p')
temp=build/$($PY -c 'import sys, sysconfig; print(f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")')/ep_comm_cuda
if [ -d $CARRY/ep_comm_cuda ] && [ "$(cat $CARRY/nvshmem_version 2>/dev/null)" = "$nvshmem_version" ] \
   && [ "$(cat $CARRY/csrc_hash 2>/dev/null)" = "$(csrc_hash)" ]; then
  mkdir -p "$temp" && cp $CARRY/ep_comm_cuda/*.o "$temp/" && touch -d "@$(date +%s)" "$temp"/*.o
  say "using the prepared CUDA objects (NVSHMEM $nvshmem_version)"
else
  say "building every CUDA object here (NVSHMEM here: $nvshmem_version)"
fi
ONLY=${1:-all}
[ "$ONLY" = codec ] || say "CUDA build in the background"
if [ "$ONLY" = codec ]; then build_pid=""; else
( EP_COMM_CUDA=1 timeout 240 $PY setup.py build_ext --inplace >> "$OUT/build.log" 2>&1; echo $? > "$OUT/.cuda_build_rc" ) &
build_pid=$!
fi

say "lossless codec: GPU tests"
libs=""
if [ "$(cat $CARRY/csrc_hash 2>/dev/null)" = "$(csrc_hash)" ]; then libs=$(ls $PWD/$CARRY/libep_codec*.so 2>/dev/null); fi
lib=""; [ -f $CARRY/libep_codec.so ] && [ -n "$libs" ] && lib=$PWD/$CARRY/libep_codec.so
for l in ${libs:-""}; do  # the default build and each prepared variant (or one built here)
  EP_COMM_CODEC_GPU_LIB=$l timeout 90 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_codec_lossless_gpu.py \
    -rfE -x --maxfail=3 >> "$OUT/codec_tests.log" 2>&1
  say "codec tests ${l##*/} rc=$?: $(tail -1 "$OUT/codec_tests.log")"
done

say "lossless codec: GPU throughput"
if [ -f $CARRY/tensors.pt ]; then
  timeout 100 $PY bench/codec_gpu.py --tensors $CARRY/tensors.pt ${lib:+--lib $lib} --chunk-values 65536,16384 \
    --json "$OUT/codec_gpu.json" >> "$LOG" 2>&1
  say "codec bench rc=$?"
  if [ "$(echo $libs | wc -w)" -gt 1 ]; then
    timeout 100 $PY bench/codec_gpu.py --tensors $CARRY/tensors.pt $(for l in $libs; do echo --lib $l; done) \
      --kinds activations,gradients --chunk-values 65536 >> "$LOG" 2>&1
    say "codec variants rc=$?"
  fi
  if [ "${EP_GPU_NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
    timeout 120 ncu --clock-control none -k regex:"split_kernel|rans_kernel|pack_kernel|decode_kernel" \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
      $PY bench/codec_gpu.py --tensors $CARRY/tensors.pt ${lib:+--lib $lib} --once --gpu-mb 256 \
      > "$OUT/ncu.log" 2>&1
    say "ncu rc=$?"
  fi
else
  say "no $CARRY/tensors.pt (bench/gpu_prepare.sh makes it): codec throughput skipped"
fi

if [ "$ONLY" = codec ]; then say "done (codec only)"; exit 0; fi
say "waiting for the CUDA build"
wait $build_pid
say "CUDA build rc=$(cat "$OUT/.cuda_build_rc" 2>/dev/null) ($(grep -c 'bin/nvcc ' "$OUT/build.log") nvcc runs)"
$PY -c "import json, ep_comm._build as b; print(json.dumps(b.build_info()))" >> "$LOG" 2>&1 || tail -30 "$OUT/build.log" >> "$LOG"

say "other GPU tests"
export EP_COMM_GPU_REPORT="$OUT/report.txt"; rm -f "$EP_COMM_GPU_REPORT"
per_test=""; $PY -c "import pytest_timeout" 2>/dev/null && per_test="--timeout 100"
timeout 170 $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu --ignore tests/gpu/test_codec_lossless_gpu.py \
  -rA $per_test > "$OUT/gpu_tests.log" 2>&1
say "GPU tests rc=$?: $(tail -1 "$OUT/gpu_tests.log")"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$OUT/gpu_tests.log" | cut -c1-300 >> "$LOG"

say "codecs through the public API on CUDA tensors (per-message cost)"
tensors_arg=""; [ -f $CARRY/tensors.pt ] && tensors_arg="--tensors $CARRY/tensors.pt"
timeout 60 $PY bench/codec_device_api.py $tensors_arg --json "$OUT/codec_device_api.json" \
  > "$OUT/codec_device_api.log" 2>&1
say "codec_device_api rc=$?"
cat "$OUT/codec_device_api.log" | cut -c1-300 >> "$LOG"

say "dispatch/combine benchmark"
for channels in 8 24; do  # intranode channels (two SMs each): DeepEP's default uses about 24 SMs
  timeout 40 $PY bench/gpu_bench.py --channels $channels >> "$OUT/gpu_bench.log" 2>&1
  say "gpu_bench --channels $channels rc=$?"
  tail -1 "$OUT/gpu_bench.log" | cut -c1-2000 >> "$LOG"
done
rm -f "$OUT/.cuda_build_rc"
say "done"
