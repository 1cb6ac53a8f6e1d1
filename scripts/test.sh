#!/usr/bin/env bash
# Every test: unit tests (release, ASan+UBSan, TSan builds), fuzz smoke runs,
# and the real-mount integration tests with checkpoints written by torch.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
JOBS=$(nproc)
# SANITIZERS=0 / FUZZ=0 skip those stages (for quick local runs).

echo "== build (RelWithDebInfo, -Werror)"
scripts/build.sh
echo "== unit tests"
ctest --test-dir build --output-on-failure -j"$JOBS"

if [[ "${SANITIZERS:-1}" == 1 ]]; then
  echo "== unit tests under ASan+UBSan"
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCKPTFS_SANITIZE="address;undefined" >/dev/null
  cmake --build build-asan -j"$JOBS" --target ckptfs_unit_tests
  ASAN_OPTIONS=detect_leaks=1 build-asan/ckptfs_unit_tests --gtest_brief=1
  echo "== unit tests under TSan"
  cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DCKPTFS_SANITIZE=thread >/dev/null
  cmake --build build-tsan -j"$JOBS" --target ckptfs_unit_tests
  TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp halt_on_error=1" build-tsan/ckptfs_unit_tests --gtest_brief=1
fi

if [[ "${FUZZ:-1}" == 1 ]]; then
  echo "== fuzz smoke (libFuzzer, 20 s per parser)"
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPTFS_FUZZ=ON \
    -DCKPTFS_BUILD_TESTS=OFF >/dev/null
  cmake --build build-fuzz -j"$JOBS" --target fuzz_zip fuzz_pickle fuzz_torch_save
  corpus=$(mktemp -d)
  cp tests/data/sample.pt tests/data/dcp_single/.metadata "$corpus/"
  for f in zip pickle torch_save; do
    build-fuzz/fuzz_$f -max_total_time=20 -max_len=65536 -rss_limit_mb=2048 "$corpus" >"build-fuzz/fuzz_$f.log" 2>&1 \
      || { tail -40 "build-fuzz/fuzz_$f.log"; exit 1; }
    echo "fuzz_$f: $(grep -c . "build-fuzz/fuzz_$f.log") log lines, no crash"
  done
  rm -rf "$corpus"
fi

echo "== integration tests (real FUSE mounts, real torch checkpoints)"
# Fixtures are written once into build/fixtures (shared by the test modules that
# use the same checkpoints; a fresh clone starts empty).
CKPTFS_FIXTURE_CACHE=${CKPTFS_FIXTURE_CACHE:-$PWD/build/fixtures} CKPTFS_BIN=$PWD/build/ckptfs \
  .venv/bin/python -m pytest tests/integration -q -p no:cacheprovider --timeout=900
