#!/usr/bin/env bash
# Installs what ckptfs needs on Debian 12 (root), idempotently.
#   scripts/setup.sh           build + run deps, numpy for the demo
#   scripts/setup.sh --test    also torch, zstandard, pytest (test-only producers/clients)
#   scripts/setup.sh --quick   only the Debian packages that build and unit-test it (no pip, no venv)
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PKGS=(build-essential cmake pkg-config git libfuse3-dev fuse3 librocksdb-dev liburing-dev libgtest-dev
          libre2-dev libyaml-dev libcli11-dev nlohmann-json3-dev libxxhash-dev libzstd-dev zlib1g-dev python3 python3-venv python3-pip python3-dev)
[[ "${1:-}" == "--test" ]] && APT_PKGS+=(clang libclang-rt-14-dev ccache clang-format)
[[ "${1:-}" == "--quick" ]] && APT_PKGS+=(ccache clang-format)
APT_PKGS+=(help2man)  # ckptfs.1 at build time (CMake leaves the man page out without it)

missing=()
for p in "${APT_PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi
[[ -e /dev/fuse ]] || mknod /dev/fuse c 10 229 || true
[[ "${1:-}" == "--quick" ]] && exit 0

# Python: a venv that sees the system's site-packages (so an installed torch is reused).
if [[ ! -x .venv/bin/python ]]; then python3 -m venv --system-site-packages .venv; fi
PY=.venv/bin/python
# pip requirement:import name (test-only producers and clients after numpy). Versions come from
# scripts/constraints.txt; a package installed at another version is reinstalled at the pin.
want=(numpy:numpy)
[[ "${1:-}" == "--test" ]] && want+=(torch:torch zstandard:zstandard pytest:pytest pytest-timeout:pytest_timeout pytest-xdist:xdist
                                     deepspeed:deepspeed megatron-core:megatron.core zarr:zarr safetensors:safetensors transformers:transformers
                                     accelerate:accelerate scikit-build-core:scikit_build_core nanobind:nanobind
                                     lightning:lightning jax:jax jaxlib:jaxlib orbax-checkpoint:orbax.checkpoint optax:optax tensorstore:tensorstore
                                     xxhash:xxhash)
need=()
for w in "${want[@]}"; do
  req=${w%%:*}
  pin=$(grep -i -m1 "^${req}==" scripts/constraints.txt | cut -d= -f3)
  have=$("$PY" -c "import importlib.metadata as m; print(m.version('${req}'))" 2>/dev/null || true)
  [[ -n "$pin" && "$have" == "$pin" ]] || need+=("$req")
done
if ((${#need[@]})); then "$PY" -m pip install -q -c scripts/constraints.txt "${need[@]}"; fi
# torchtitan (the hf/ tests' producer): its model and checkpointer need only these; its declared
# dependencies (datasets, tensorboard, ...) are for training runs, so they are left out (--no-deps).
if [[ "${1:-}" == "--test" ]]; then
  nodeps=()
  for req in torchtitan tyro docstring-parser spmd_types; do
    pin=$(grep -i -m1 "^${req}==" scripts/constraints.txt | cut -d= -f3)
    have=$("$PY" -c "import importlib.metadata as m; print(m.version('${req}'))" 2>/dev/null || true)
    [[ -n "$pin" && "$have" == "$pin" ]] || nodeps+=("$req==$pin")
  done
  if ((${#nodeps[@]})); then "$PY" -m pip install -q --no-deps "${nodeps[@]}"; fi
fi
