#!/usr/bin/env bash
# GPU check for the NVIDIA backend: builds ep_comm._cuda if needed, runs every GPU test and a short
# benchmark, prints a summary. Meant to finish in under 5 minutes on one H200.
#   usage: bench/gpu_check.sh            (from the repository root; PYTHON=... to pick python)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
start=$(date +%s)
summary() { echo "== $1"; }

summary "python: $PY ($($PY -c 'import torch; print(torch.__version__, torch.cuda.is_available())'))"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || echo "WARNING: no CUDA GPU visible: GPU tests will skip"
if ! $PY -c "import pybind11" 2>/dev/null; then
  ls .whl/pybind11-*.whl >/dev/null 2>&1 && $PY -m pip install -q --no-index --find-links .whl pybind11
fi
if ! $PY -c "import ep_comm._cuda, ep_comm._host" 2>/dev/null; then
  summary "building (EP_COMM_CUDA=1)"
  b0=$(date +%s)
  EP_COMM_CUDA=1 $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
  summary "build took $(( $(date +%s) - b0 )) s"
fi
$PY -c "import json, ep_comm._build as b; print(json.dumps(b.build_info()))" | tee "$OUT/build_info.json"

summary "GPU tests"
export EP_COMM_GPU_REPORT="$OUT/report.txt"; rm -f "$EP_COMM_GPU_REPORT"
timeout 240 $PY -m pytest -q -m gpu tests/gpu -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
tests_rc=${PIPESTATUS[0]}

summary "benchmark"
timeout 90 $PY bench/gpu_bench.py > "$OUT/bench.log" 2>&1
bench_rc=$?
tail -5 "$OUT/bench.log"

summary "SUMMARY"
echo "tests: $(grep -E ' in [0-9.]+s' "$OUT/gpu_tests.log" | tail -1) (rc=$tests_rc)"
cat "$EP_COMM_GPU_REPORT" 2>/dev/null
if [ $bench_rc -eq 0 ]; then
  $PY - "$OUT/bench.log" <<'PYEOF'
import json, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print(f"device {s['device']}: copy {s['copy_GBps']:.0f} GB/s")
n, l = s["normal"], s["low_latency"]
print(f"normal dispatch {n['dispatch_GBps']:.0f} GB/s ({s['normal_dispatch_fraction']:.2f} of copy), "
      f"combine {n['combine_GBps']:.0f} GB/s ({s['normal_combine_fraction']:.2f}); target {s['target_fraction']}")
print(f"low-latency dispatch {l['dispatch_us']:.0f} us, combine {l['combine_us']:.0f} us")
PYEOF
else
  echo "benchmark failed (rc=$bench_rc), see $OUT/bench.log"
fi
echo "total $(( $(date +%s) - start )) s"
