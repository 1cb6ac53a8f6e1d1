#!/usr/bin/env bash
# Builds ckptfs into build/ (RelWithDebInfo, -Werror, unit tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)"
