#!/usr/bin/env bash
# Runs the benchmarks (not part of CI): bash bench/run.sh [dcp|ds|resume|mresume|megatron|verify|topo|hf|maxtext|py|transforms|read|scale] [args...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
scripts/build.sh
which="${1:-all}"; [[ $# -gt 0 ]] && shift
if [[ "$which" == dcp || "$which" == all ]]; then .venv/bin/python bench/dcp_bench.py "$@"; fi
if [[ "$which" == ds || "$which" == all ]]; then .venv/bin/python bench/ds_bench.py "$@"; fi
if [[ "$which" == resume || "$which" == all ]]; then .venv/bin/python bench/resume_bench.py "$@"; fi
if [[ "$which" == mresume || "$which" == all ]]; then .venv/bin/python bench/megatron_resume_bench.py "$@"; fi
if [[ "$which" == megatron || "$which" == all ]]; then .venv/bin/python bench/megatron_bench.py "$@"; fi
if [[ "$which" == verify || "$which" == all ]]; then .venv/bin/python bench/verify_bench.py "$@"; fi
if [[ "$which" == topo || "$which" == all ]]; then .venv/bin/python bench/topo_bench.py "$@"; fi
if [[ "$which" == hf || "$which" == all ]]; then .venv/bin/python bench/hf_bench.py "$@"; fi
if [[ "$which" == maxtext || "$which" == all ]]; then .venv/bin/python bench/maxtext_hf_bench.py "$@"; fi
# The Python package (pip wheel + install into .venv, as scripts/test.sh does).
if [[ "$which" == py || "$which" == all ]]; then
  scripts/py_package.sh
  .venv/bin/python bench/py_bench.py "$@"
fi
if [[ "$which" == transforms || "$which" == all ]]; then
  mkdir -p bench/out
  build/ckptfs_transform_bench "bench/out/transforms-$(hostname).json"
fi
if [[ "$which" == read || "$which" == all ]]; then .venv/bin/python bench/read_bench.py "$@"; fi
# Issue 18's proof: the scale inputs (index, mount, listing, reference checks),
# then reads against the null-FUSE ceiling, in one run. Not part of `all`.
if [[ "$which" == scale ]]; then
  .venv/bin/python bench/scale_bench.py "$@"
  .venv/bin/python bench/read_bench.py
fi
