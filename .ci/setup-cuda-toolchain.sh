#!/usr/bin/env bash
# Vendored copy of the team's own CUDA toolchain script (what it installs and how to run the
# binaries on a GPU machine: docs/cuda.md), so that CI works on a checkout alone. Only these
# first 8 lines differ from the original: update both together. tests/readme.rs compares
# everything below line 8 with the original's body whenever the team's shared folder sits
# beside the checkout. .ci/run runs it (through sudo when CI is not root:
# it writes to /opt and may apt-get install build-essential / python3-pip).
#
# Installs a CUDA 13.0 build toolchain (nvcc + headers + link-time libraries)
# from PyPI wheels into a fixed prefix, so that Rust crates using candle's
# `cuda` feature (cudarc with `dynamic-linking`, candle-kernels via nvcc) can be
# BUILT on a machine without a GPU and without a system CUDA install.
#
# The binaries it produces run on a machine whose NVIDIA driver supports
# CUDA 13.0 (e.g. driver 580.x). nvcc is pinned to 13.0 on purpose: PTX written
# by a newer nvcc (13.1+) is rejected by a 13.0 driver.
#
# Usage (as root, idempotent):
#   bash shared/cuda/setup-cuda-toolchain.sh            # installs into /opt/cuda13
#   CUDA13_PREFIX=/somewhere bash setup-cuda-toolchain.sh
#   WITH_NCCL=0 bash setup-cuda-toolchain.sh            # skip the 200 MB NCCL wheel
# Then:
#   source /opt/cuda13/env.sh && cargo build --release --features cuda
set -euo pipefail

PREFIX="${CUDA13_PREFIX:-/opt/cuda13}"
WITH_NCCL="${WITH_NCCL:-1}"
COMPUTE_CAP_DEFAULT="${CUDA_COMPUTE_CAP_DEFAULT:-90}"   # H100/H200 = 90

# Pinned wheels: everything from the CUDA 13.0 release line.
PKGS=(
  nvidia-cuda-nvcc==13.0.88      # nvcc, ptxas, fatbinary, nvlink
  nvidia-cuda-crt==13.0.88       # crt/ headers nvcc needs
  nvidia-nvvm==13.0.88           # cicc + libdevice (nvcc's front end)
  nvidia-cuda-cccl==13.0.85      # cub/thrust/libcu++ headers (include/cccl)
  nvidia-cuda-runtime==13.0.96   # cuda_runtime.h, libcudart.so.13
  nvidia-cuda-nvrtc==13.0.88     # libnvrtc.so.13
  nvidia-cublas==13.0.2.14       # libcublas.so.13, libcublasLt.so.13
  nvidia-curand==10.4.0.35       # libcurand.so.10
)
if [ "$WITH_NCCL" = 1 ]; then
  PKGS+=(nvidia-nccl-cu13==2.28.9)  # libnccl.so.2 + nccl.h (only for candle's `nccl` feature)
fi

PY="${PYTHON:-python3}"
need() { command -v "$1" >/dev/null 2>&1; }

# Host compiler for nvcc and for the libcuda stub.
if ! need gcc || ! need g++; then
  echo "[cuda13] installing gcc/g++ (build-essential)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential
fi
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  echo "[cuda13] installing python3-pip"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip
fi

STAMP="$PREFIX/.pins"
PINS="$(printf '%s\n' "${PKGS[@]}")"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ] && [ -x "$PREFIX/cuda/bin/nvcc" ]; then
  echo "[cuda13] wheels already installed in $PREFIX/pip"
else
  echo "[cuda13] installing wheels into $PREFIX/pip"
  mkdir -p "$PREFIX"
  rm -rf "$PREFIX/pip.new"
  # --break-system-packages is harmless with --target, and needed by Debian's pip (PEP 668)
  extra=()
  piphelp="$("$PY" -m pip install --help 2>/dev/null || true)"
  if grep -q -- --break-system-packages <<<"$piphelp"; then extra+=(--break-system-packages); fi
  if grep -q -- --root-user-action <<<"$piphelp"; then extra+=(--root-user-action=ignore); fi
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile \
      --only-binary=:all: --target "$PREFIX/pip.new" "${extra[@]}" "${PKGS[@]}"
  rm -rf "$PREFIX/pip"
  mv "$PREFIX/pip.new" "$PREFIX/pip"
  printf '%s\n' "${PKGS[@]}" > "$STAMP"
fi

# All CUDA 13 wheels unpack into one tree: nvidia/cu13/{bin,include,lib,nvvm}.
ln -sfn pip/nvidia/cu13 "$PREFIX/cuda"
T="$PREFIX/cuda"
ln -sfn lib "$T/lib64"   # some tools look for lib64

# Unversioned names for the linker (cudarc emits -lcublas -lcublasLt -lcurand
# -lnvrtc [-lnccl] [-lcuda]; candle-kernels emits -lcudart).
cd "$T/lib"
for f in libcudart.so.13 libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10; do
  [ -e "$f" ] || { echo "[cuda13] missing $T/lib/$f" >&2; exit 1; }
  ln -sfn "$f" "${f%%.so.*}.so"
done
if [ "$WITH_NCCL" = 1 ]; then
  ln -sfn ../../nccl/lib/libnccl.so.2 libnccl.so
  ln -sfn ../../nccl/include/nccl.h "$T/include/nccl.h"
else
  rm -f libnccl.so "$T/include/nccl.h"
fi

# libcuda.so is the driver's library and ships with no wheel. Build a link-time
# stub with soname libcuda.so.1 that exports every cu* function declared in
# the 13.0 cuda.h (incl. _v2/_ptsz/_ptds variants); each returns
# CUDA_ERROR_STUB_LIBRARY (34), like NVIDIA's own stub. At run time the real
# driver's libcuda.so.1 is loaded instead; never ship or LD_LIBRARY_PATH this stub.
mkdir -p "$T/lib/stubs"
STUB_SRC="$T/lib/stubs/libcuda_stub.c"
if [ ! -f "$T/lib/stubs/libcuda.so" ] || [ "$T/include/cuda.h" -nt "$T/lib/stubs/libcuda.so" ] \
   || ! grep -q 'return 34' "$STUB_SRC" 2>/dev/null; then
  echo "[cuda13] generating libcuda.so stub"
  {
    for d in "" "-D__CUDA_API_VERSION_INTERNAL" "-DCUDA_API_PER_THREAD_DEFAULT_STREAM"; do
      echo '#include <cuda.h>' | gcc -E -P -x c $d -I"$T/include" -
    done
  } | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | sed -E 's/[[:space:]]*\($//' | sort -u \
    | awk 'BEGIN{print "/* generated link stub for libcuda.so.1: every call returns CUDA_ERROR_STUB_LIBRARY */"} {print "int " $1 "(void) { return 34; }"}' > "$STUB_SRC"
  gcc -shared -fPIC -O0 -w -Wl,-soname,libcuda.so.1 -o "$T/lib/stubs/libcuda.so" "$STUB_SRC"
  echo "[cuda13] stub exports $(grep -c '^int ' "$STUB_SRC") symbols"
fi

cat > "$PREFIX/env.sh" <<EOF
# Source before building candle with the cuda feature:  source $PREFIX/env.sh
export CUDA13_PREFIX="$PREFIX"
export CUDA_HOME="$T"
export CUDA_PATH="$T"
export CUDA_ROOT="$T"
export CUDA_TOOLKIT_ROOT_DIR="$T"
export NVCC="$T/bin/nvcc"
case ":\$PATH:" in *":$T/bin:"*) ;; *) export PATH="$T/bin:\$PATH" ;; esac
# link-time search path (gcc passes LIBRARY_PATH to ld); stubs/ holds libcuda.so
export LIBRARY_PATH="$T/lib:$T/lib/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
# cudarc: pick the CUDA 13.0 API without asking nvcc
export CUDARC_CUDA_VERSION=13000
# candle-kernels (cudaforge): no nvidia-smi here, so name the GPU generation.
# 90 -> nvcc -gencode=arch=compute_90a,code=sm_90a (Hopper: H100/H200)
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-$COMPUTE_CAP_DEFAULT}"
EOF

# Smoke test: nvcc works and emits PTX 9.0 (what a 13.0 driver accepts).
tmp="$(mktemp -d)"
printf 'extern "C" __global__ void k(float* a){ a[threadIdx.x] += 1.0f; }\n' > "$tmp/k.cu"
"$T/bin/nvcc" -arch=sm_90 --ptx -o "$tmp/k.ptx" "$tmp/k.cu"
ptxv="$(grep -m1 '^\.version' "$tmp/k.ptx" | awk '{print $2}')"
rm -rf "$tmp"
echo "[cuda13] $("$T/bin/nvcc" --version | grep -o 'release [0-9.]*, V[0-9.]*'), PTX ISA $ptxv"
echo "[cuda13] ready: source $PREFIX/env.sh"
