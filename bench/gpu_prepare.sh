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
$PY bench/codec_gpu.py --build-lib $CARRY/libep_codec.so --arch 90
# tuning variants of the same kernels (gpu_check.sh tests and times each beside the default); by
# default the decoder's L1 prefetch distances not yet measured on a GPU (EP_CODEC_VARIANTS="" for none)
rm -f $CARRY/libep_codec_*.so
for variant in ${EP_CODEC_VARIANTS-dec_pf256:EP_LOSSLESS_DEC_PREFETCH=256 dec_pf1k:EP_LOSSLESS_DEC_PREFETCH=1024}; do
  $PY bench/codec_gpu.py --build-lib $CARRY/libep_codec_${variant%%:*}.so --arch 90 --define ${variant#*:}
done
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} EP_COMM_CUDA=1 EP_COMM_CUDA_ARCHS=90 $PY setup.py build_ext --inplace > /dev/null
temp=build/$($PY -c 'import sys, sysconfig; print(f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")')/ep_comm_cuda
rm -f $CARRY/ep_comm_cuda/*.o
cp "$temp"/*.cu.90_nvshmem.o "$temp"/dlink.90_nvshmem.o $CARRY/ep_comm_cuda/
$PY -m pip show nvidia-nvshmem-cu13 | sed -n 's/^Version: //p' > $CARRY/nvshmem_version
find csrc -type f | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16 > $CARRY/csrc_hash
du -sh $CARRY
