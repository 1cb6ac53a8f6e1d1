#!/usr/bin/env bash
# Runs the benchmarks (not part of CI): bash bench/run.sh [--gib 2.0]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
scripts/build.sh
.venv/bin/python bench/dcp_bench.py "$@"
