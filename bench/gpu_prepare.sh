#!/usr/bin/env bash
# Prepares .gpu_carry/ for bench/gpu_check.sh on a machine without a GPU, so that a short device
# lease spends its minutes on tests, not on builds and model downloads:
#   tensors.pt       real BF16 tensors of all-MiniLM-L6-v2 (bench/codec_bench.py --save-tensors, 10 MB/kind)
#   libep_codec.so   the lossless codec kernels for sm_90 (bench/codec_gpu.py --build-lib)
#   ep_comm_cuda/    the CUDA objects of ep_comm._cuda (Python-independent), with the NVSHMEM wheel
#                    version and a hash of csrc/ they were built from; gpu_check.sh uses them only
#                    when both match there.
# The intranode kernels' variants (ring or direct writes, warps per destination rank) are choices
# at run time within these objects: one bench/gpu_bench.py run in gpu_check.sh times each.
# usage: bench/gpu_prepare.sh   (then carry .gpu_carry to the GPU machine; keep it git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CARRY=.gpu_carry
mkdir -p $CARRY/ep_comm_cuda
[ -f $CARRY/tensors.pt ] || $PY bench/codec_bench.py --save-tensors $CARRY/tensors.pt --max-mb 10
# tuning variants of the same kernels (gpu_check.sh tests and times each beside the default):
# "name:MACRO=value[,MACRO=value...]" separated by spaces; each library's ptxas report is kept
# beside it (<lib>.ptxas.txt, logged by gpu_check.sh). EP_CODEC_VARIANTS="" for none.
# The default build decodes 16-byte aligned data on the staged decoder (decode_rans_warp_staged, not
# yet measured on a GPU); the default variants build the per-step decoder (EP_LOSSLESS_DEC_STAGED=0),
# the default before it (dec_step: 40 warps per SM, 48 registers, no spills), and its options not
# yet measured either: L1 prefetch 256 B ahead (L1 left beside shared memory), register windows at
# 8 blocks per SM (62 registers), early loads at 10 blocks (48 registers).
rm -f $CARRY/libep_codec*.so $CARRY/libep_codec*.ptxas.txt
S=EP_LOSSLESS_DEC_STAGED=0
default_variants="dec_step:$S"
default_variants+=" dec_pf256:$S,EP_LOSSLESS_DEC_PREFETCH=256,EP_LOSSLESS_DEC_CARVEOUT=60"
default_variants+=" dec_win64:$S,EP_LOSSLESS_DEC_WINDOW=1,EP_LOSSLESS_DEC_MIN_BLOCKS=8"
default_variants+=" dec_early48:$S,EP_LOSSLESS_DEC_EARLY_LOADS=1,EP_LOSSLESS_DEC_MIN_BLOCKS=10"
$PY bench/codec_gpu.py --build-lib $CARRY/libep_codec.so --arch 90
for variant in ${EP_CODEC_VARIANTS-$default_variants}; do
  defines=()
  IFS=, read -ra macros <<< "${variant#*:}"
  for m in "${macros[@]}"; do defines+=(--define "$m"); done
  $PY bench/codec_gpu.py --build-lib $CARRY/libep_codec_${variant%%:*}.so --arch 90 "${defines[@]}"
done
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} EP_COMM_CUDA=1 EP_COMM_CUDA_ARCHS=90 $PY setup.py build_ext --inplace > /dev/null
temp=build/$($PY -c 'import sys, sysconfig; print(f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")')/ep_comm_cuda
rm -f $CARRY/ep_comm_cuda/*.o
cp "$temp"/*.cu.90_nvshmem.o "$temp"/dlink.90_nvshmem.o $CARRY/ep_comm_cuda/
$PY -m pip show nvidia-nvshmem-cu13 | sed -n 's/^Version: //p' > $CARRY/nvshmem_version
find csrc -type f | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16 > $CARRY/csrc_hash
du -sh $CARRY
