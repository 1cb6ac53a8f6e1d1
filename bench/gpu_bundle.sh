#!/usr/bin/env bash
# Prepares build-gpu/, what bench/gpu_check.sh needs on a lent GPU machine,
# which reaches no registry and lacks RocksDB, libfuse and liburing: the
# binaries of build/ (stripped), the shared libraries they and the Python
# extension need that a bare CUDA image lacks, and the Python package built
# for that machine's CPython 3.12 (pyenv's 3.12 here; its torch is
# the machine's own). Run here, then:
#   run(command="bash bench/gpu_check.sh", carry=["build-gpu"], timeout_s=480)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z ${PY312:-} ]]; then
  for c in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
    if "$c" -c '' 2>/dev/null; then PY312=$c; break; fi
  done
fi
[[ -n ${PY312:-} ]] || { echo "no CPython 3.12 here (set PY312)"; exit 1; }
scripts/build.sh >/dev/null
# The extension for CPython 3.12: the same sources and flags as build/ (ccache
# reuses its objects), only _ckptfs linked against 3.12's headers.
"$PY312" -m pip install -q "nanobind==$(grep -m1 '^nanobind==' scripts/constraints.txt | cut -d= -f3)"
cmake -S . -B build-py312 -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPTFS_PYTHON=ON -DCKPTFS_BUILD_TESTS=OFF \
  -DPython_EXECUTABLE="$PY312" >/dev/null
cmake --build build-py312 -j"$(nproc)" --target _ckptfs
rm -rf build-gpu
mkdir -p build-gpu/bin build-gpu/lib build-gpu/py/ckptfs
for b in ckptfs ckptfs_unit_tests ckptfs_transform_bench; do strip -o "build-gpu/bin/$b" "build/$b"; done
cp python/ckptfs/*.py build-gpu/py/ckptfs/
strip -o "build-gpu/py/ckptfs/$(basename build-py312/_ckptfs*.so)" build-py312/_ckptfs*.so
# Every library they load but glibc's, the compiler runtime and the CUDA driver.
for f in build-gpu/bin/* build-gpu/py/ckptfs/*.so; do ldd "$f"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*|libgcc_s|libstdc\+\+|libcuda)\.so' |
  while read -r lib; do cp -L "$lib" build-gpu/lib/; done
cp -L /usr/bin/fusermount3 build-gpu/bin/ 2>/dev/null || true
du -sh build-gpu
