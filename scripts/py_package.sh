#!/usr/bin/env bash
# Builds the Python package's wheel from this tree (build-py/wheel, the same
# build `pip install .` runs: pyproject.toml) and installs it into .venv.
# -Werror and the main build's type, so ccache shares the main build's objects.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf build-py/wheel
.venv/bin/python -m pip wheel -q --no-build-isolation --no-deps -C cmake.define.CKPTFS_WERROR=ON -w build-py/wheel .
.venv/bin/python -m pip install -q --no-deps --force-reinstall build-py/wheel/ckptfs-*.whl
