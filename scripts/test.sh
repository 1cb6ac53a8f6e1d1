#!/usr/bin/env bash
# Every test: style, unit tests (release, ASan+UBSan, TSan builds) with the
# reader conformance suite, fuzz smoke runs, and the real-mount integration
# tests with checkpoints written by the real producers.
#   scripts/test.sh           everything (what CI runs; installs the Python stack)
#   scripts/test.sh --quick   style, build, unit tests and the conformance suite over
#                             every committed fixture: Debian packages only, no pip
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=$(nproc)
stage() { echo "== $* ($(date -u +%H:%M:%S), $SECONDS s in)"; }
# SANITIZERS=0 / FUZZ=0 skip those stages (for quick local runs).

if [[ "${1:-}" == "--quick" ]]; then
  stage "setup (Debian packages only)"
  scripts/setup.sh --quick
  stage "style (clang-format)"
  scripts/check_format.sh
  stage "build (RelWithDebInfo, -Werror)"
  scripts/build.sh
  stage "unit tests and the reader conformance suite"
  ctest --test-dir build --output-on-failure -j"$JOBS"
  stage "quick tests passed"
  exit 0
fi

scripts/setup.sh --test
stage "style (clang-format)"
scripts/check_format.sh
stage "build (RelWithDebInfo, -Werror)"
scripts/build.sh
stage "python package (wheel built from this tree, installed into .venv)"
scripts/py_package.sh  # the integration tests import it
stage "unit tests"
ctest --test-dir build --output-on-failure -j"$JOBS"

# The sanitizer and fuzz stages run beside the integration tests, niced: the
# integration tests leave about a quarter of the CPUs idle (FUSE round trips,
# producers waiting on gloo), which these stages use instead of adding their
# own half hour after them. Their output goes to build/beside.log, printed
# when they finish; a failure in either half fails the run.
beside() {
  if [[ "${SANITIZERS:-1}" == 1 ]]; then
    stage "unit tests under ASan+UBSan"
    cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCKPTFS_SANITIZE="address;undefined" >/dev/null
    cmake --build build-asan -j"$JOBS" --target ckptfs_unit_tests
    ASAN_OPTIONS=detect_leaks=1 build-asan/ckptfs_unit_tests --gtest_brief=1
    stage "unit tests under TSan"
    cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DCKPTFS_SANITIZE=thread >/dev/null
    cmake --build build-tsan -j"$JOBS" --target ckptfs_unit_tests
    TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp halt_on_error=1" build-tsan/ckptfs_unit_tests --gtest_brief=1
  fi

  if [[ "${FUZZ:-1}" == 1 ]]; then
    stage "fuzz smoke (libFuzzer, 20 s per target)"
    CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPTFS_FUZZ=ON \
      -DCKPTFS_BUILD_TESTS=OFF -DCKPTFS_CUDA=OFF >/dev/null
    mapfile -t dirs < <(ls tests/fuzz/corpus)  # one target per seed directory (CMakeLists.txt)
    cmake --build build-fuzz -j"$JOBS" --target fuzz_zip fuzz_pickle fuzz_torch_save fuzz_ocdbt "${dirs[@]/#/fuzz_}"
    work=$(mktemp -d)
    mkdir "$work/parsers"
    cp tests/data/sample.pt tests/data/dcp_single/.metadata "$work/parsers/"
    fuzz() {  # target corpus-dir max-len
      build-fuzz/fuzz_$1 -max_total_time=20 -max_len="$3" -rss_limit_mb=2048 -timeout=30 "$2" \
        >"build-fuzz/fuzz_$1.log" 2>&1 || { tail -60 "build-fuzz/fuzz_$1.log"; exit 1; }
      echo "fuzz_$1: $(grep -o 'cov: [0-9]*' "build-fuzz/fuzz_$1.log" | tail -1), $(grep -c . "build-fuzz/fuzz_$1.log") log lines, no crash"
    }
    for f in zip pickle torch_save; do fuzz "$f" "$work/parsers" 65536; done
    cp -r tests/fuzz/ocdbt_seeds "$work/ocdbt"  # real orbax databases (tests/fuzz/make_corpus.py)
    fuzz ocdbt "$work/ocdbt" 1500000
    for f in "${dirs[@]}"; do  # seeds: real producer checkpoints (tests/fuzz/make_corpus.py)
      cp -r "tests/fuzz/corpus/$f" "$work/$f"
      fuzz "$f" "$work/$f" 1500000
    done
    rm -rf "$work"
  fi
}
mkdir -p build
stage "sanitizer and fuzz stages start beside the integration tests (log: build/beside.log)"
( renice -n 19 -p "$BASHPID" >/dev/null; beside ) >build/beside.log 2>&1 &
beside_pid=$!

stage "integration tests (real FUSE mounts, real torch checkpoints)"
# Fixtures are written once into build/fixtures (shared by the test modules that
# use the same checkpoints; a fresh clone starts empty). One pytest-xdist worker
# per core, a module per worker at a time (tests/integration/conftest.py): the
# producers that write the fixtures are mostly single-threaded Python.
CKPTFS_FIXTURE_CACHE=${CKPTFS_FIXTURE_CACHE:-$PWD/build/fixtures} CKPTFS_BIN=$PWD/build/ckptfs \
  .venv/bin/python -m pytest tests/integration -q -p no:cacheprovider --timeout=900 -n "$JOBS" --dist loadgroup \
  --durations=25 || { rc=$?; wait "$beside_pid" || true; echo "== beside the integration tests:"; cat build/beside.log; exit "$rc"; }
stage "integration tests passed; waiting for the sanitizer and fuzz stages"
beside_rc=0
wait "$beside_pid" || beside_rc=$?
cat build/beside.log
((beside_rc == 0)) || { echo "sanitizer or fuzz stage failed (exit $beside_rc)"; exit "$beside_rc"; }
stage "all tests passed"
