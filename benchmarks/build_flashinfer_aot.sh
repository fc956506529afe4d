#!/usr/bin/env bash
# .vstage4 built here, on a machine without a GPU: FlashInfer's sampling and top-k modules for the
# lent H100 / H200 (sm_90a), xz-compressed as `run_h200.sh jit` leaves them, so that no device
# call spends its 4-8 minutes on FlashInfer's JIT.
#     bash benchmarks/build_flashinfer_aot.sh        # ~3 min on 2 vCPUs -> .vstage4/{topk,sampling}.so.xz
# Needs what `scripts/test.sh` installs (vllm 0.26.0 brings flashinfer-python 0.6.14, apache-tvm-ffi
# 0.1.10 and the CUDA 13 wheels: the device's versions) and nvcc (CUDA 13). Two things the JIT
# finds on a GPU machine are supplied: curand's headers (from the nvidia-curand wheel, alone on
# the include path, so that the toolkit's other headers are still nvcc's own), the CUDA runtime to
# link against (the nvidia-cuda-runtime wheel's, which torch loads too) and a libcuda (an empty
# one named libcuda.so.1, as the driver's own stub is: the symbols resolve against the device's
# driver when the module loads).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# in_wheels PATTERN: the first file of the nvidia wheels matching PATTERN (cu*/include/curand.h)
in_wheels() {
  python3 -c "import glob, nvidia; print(*sorted(glob.glob(nvidia.__path__[0] + '/$1'))[:1])" \
    | grep . || { echo "$1 is not in the installed nvidia wheels (run scripts/test.sh first)" >&2
                  exit 1; }
}
curand=$(in_wheels "cu*/include/curand.h")
cudart=$(in_wheels "cu*/lib/libcudart.so.*")
mkdir -p "$work/include" "$work/lib"
ln -s "$(dirname "$curand")"/curand*.h "$work/include/"
ln -s "$cudart" "$work/lib/libcudart.so"
echo > "$work/empty.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$work/lib/libcuda.so" "$work/empty.c"
export CPATH="$work/include" LIBRARY_PATH="$work/lib"
export FLASHINFER_CUDA_ARCH_LIST="9.0" FLASHINFER_WORKSPACE_BASE="$work" MAX_JOBS=$(nproc)
mkdir -p .vstage4
python3 - <<'EOF'
import lzma, pathlib
from flashinfer.jit.sampling import gen_sampling_module
from flashinfer.jit.topk import gen_topk_module

for spec in (gen_topk_module(), gen_sampling_module()):
    spec.build(verbose=False)
    library = spec.jit_library_path
    packed = pathlib.Path(".vstage4") / (library.name + ".xz")
    packed.write_bytes(lzma.compress(library.read_bytes(), preset=9))
    print(f"{packed}: {packed.stat().st_size / 2**20:.1f} MiB")
EOF
