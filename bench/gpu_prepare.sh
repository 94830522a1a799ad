#!/usr/bin/env bash
# Prepares .gpu_carry/ for bench/gpu_check.sh on a machine without a GPU, so that a short device
# lease spends its minutes on tests, not on builds and model downloads:
#   tensors.pt       real BF16 tensors of all-MiniLM-L6-v2 (bench/codec_bench.py --save-tensors, 10 MB/kind)
#   libep_codec.so   the lossless codec kernels for sm_90 (bench/codec_gpu.py --build-lib)
#   ep_comm_cuda/    the CUDA objects of ep_comm._cuda (Python-independent), with the NVSHMEM wheel
#                    version and a hash of csrc/ they were built from; gpu_check.sh uses them only
#                    when both match there.
# usage: bench/gpu_prepare.sh   (then carry .gpu_carry to the GPU machine; keep it git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CARRY=.gpu_carry
mkdir -p $CARRY/ep_comm_cuda
[ -f $CARRY/tensors.pt ] || $PY bench/codec_bench.py --save-tensors $CARRY/tensors.pt --max-mb 10
# tuning variants of the same kernels (gpu_check.sh tests and times each beside the default):
# "name:MACRO=value[,MACRO=value...]" separated by spaces. By default the decoder options not yet
# measured on a GPU: L1 prefetch 256 B / 1 KiB ahead (with L1 left beside shared memory), register
# windows capped at 48 registers (10 blocks per SM; ptxas spills about 20 bytes there) and at 64
# (8 blocks per SM: 62 registers, no spills), early loads (a step's word and raw-field loads in
# flight together) at 32 registers (spills 32 bytes) and at 48 (no spills); each library's
# ptxas report is kept beside it
# (<lib>.ptxas.txt, logged by gpu_check.sh). EP_CODEC_VARIANTS="" for none.
rm -f $CARRY/libep_codec*.so $CARRY/libep_codec*.ptxas.txt
default_variants="dec_pf256:EP_LOSSLESS_DEC_PREFETCH=256,EP_LOSSLESS_DEC_CARVEOUT=60"
default_variants+=" dec_pf1k:EP_LOSSLESS_DEC_PREFETCH=1024,EP_LOSSLESS_DEC_CARVEOUT=60"
default_variants+=" dec_win48:EP_LOSSLESS_DEC_WINDOW=1,EP_LOSSLESS_DEC_MIN_BLOCKS=10"
default_variants+=" dec_win64:EP_LOSSLESS_DEC_WINDOW=1,EP_LOSSLESS_DEC_MIN_BLOCKS=8"
default_variants+=" dec_early:EP_LOSSLESS_DEC_EARLY_LOADS=1"
default_variants+=" dec_early48:EP_LOSSLESS_DEC_EARLY_LOADS=1,EP_LOSSLESS_DEC_MIN_BLOCKS=10"
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
