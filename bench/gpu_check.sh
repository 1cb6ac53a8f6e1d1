#!/usr/bin/env bash
# Every GPU check of ckptfs in one run on a lent GPU machine (at most 8
# minutes; the device tool's run, with build-gpu/ from bench/gpu_bundle.sh
# carried). Writes what it measured under $OUT (default bench/out/gpu):
#   device.txt           nvidia-smi, driver, CUDA runtime, /dev/fuse
#   unit_tests.txt       every unit test on the device (the CUDA conformance
#                        and device-output tests run instead of skipping)
#   transform_bench.json GB/s per transform (pageable, pinned pipeline,
#                        device output), crossovers, auto/cpu per plan
#   gpu_on_off.txt       every params/ file served with --gpu=on and
#                        --gpu=off compared byte for byte (through FUSE where
#                        /dev/fuse exists, else through `ckptfs cat`, the same
#                        Filesystem::Read without the kernel)
#   device_read.json     device-resident loads vs the host path, idle release
#   summary.txt          one line per check, PASS or FAIL
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
G=$PWD/build-gpu
export LD_LIBRARY_PATH=$G/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=$G/py PYTHONUNBUFFERED=1
PY=${PY:-python3}
WORK=$(mktemp -d)
summary() { echo "$1 $2" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"
[[ -x $G/bin/ckptfs ]] || { summary FAIL "build-gpu/ missing: run bench/gpu_bundle.sh here and carry build-gpu"; exit 1; }
# The unit tests find their fixtures by the path they were built at.
data_dir=$(grep -aoE '/[[:alnum:]_./+-]*/tests/data' "$G/bin/ckptfs_unit_tests" | head -1 || true)
if [[ -n $data_dir && ! -d $data_dir ]]; then
  root=$(dirname "$(dirname "$data_dir")")
  mkdir -p "$(dirname "$root")" && ln -sfn "$PWD" "$root"
fi

{ nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
  echo "/dev/fuse: $([[ -e /dev/fuse ]] && echo present || echo absent)"; uname -a; $PY -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
} >"$OUT/device.txt" 2>&1

SECONDS=0
timeout 150 "$G/bin/ckptfs_unit_tests" --gtest_brief=1 >"$OUT/unit_tests.txt" 2>&1
rc=$?; skipped=$(grep -c '\[  SKIPPED \]' "$OUT/unit_tests.txt")
summary "$([[ $rc == 0 ]] && echo PASS || echo FAIL)" "unit tests on the device (rc $rc, $skipped skipped, ${SECONDS}s)"

SECONDS=0
timeout 120 "$G/bin/ckptfs_transform_bench" "$OUT/transform_bench.json" >"$OUT/transform_bench.txt" 2>&1
rc=$?; summary "$([[ $rc == 0 ]] && echo PASS || echo FAIL)" "transform bench, every GPU output equal to the CPU's (rc $rc, ${SECONDS}s)"

SECONDS=0
timeout 200 $PY bench/gpu_device_read.py "$WORK/dr" --gib 1.0 --json "$OUT/device_read.json" >"$OUT/device_read.txt" 2>&1
rc=$?; summary "$([[ $rc == 0 ]] && echo PASS || echo FAIL)" "device-resident loads, idle release (rc $rc, ${SECONDS}s)"

# --gpu=on against --gpu=off, every params/ file of the same checkpoint.
SECONDS=0
src=$WORK/dr/bf16_fsdp_w4
(
  if [[ ! -d $src ]]; then echo "no checkpoint (the device-read step failed first)"; exit 1; fi
  ck=$G/bin/ckptfs
  # `ckptfs ls` prints "<size>  <name>[/]": every parameter's param.npy
  # (bf16 widened to float32: the transform work) and param.raw.
  files=$("$ck" ls "$src" params --gpu=off --index "$WORK/idx_off" | awk '{print $2}' | tr -d / |
          while read -r d; do echo "params/$d/param.npy params/$d/param.raw"; done)
  n=0; bad=0
  if [[ -e /dev/fuse ]] && mkdir -p "$WORK/on" "$WORK/off" && PATH=$G/bin:$PATH timeout 60 "$ck" mount "$src" "$WORK/on" --gpu=on --mapped-reads=off --index "$WORK/idx_on" \
     && PATH=$G/bin:$PATH timeout 60 "$ck" mount "$src" "$WORK/off" --gpu=off --mapped-reads=off --index "$WORK/idx_off"; then
    echo "through FUSE mounts (/dev/fuse present)"
    for f in $files; do n=$((n+1)); cmp -s "$WORK/on/$f" "$WORK/off/$f" || { bad=$((bad+1)); echo "DIFFERS: $f"; }; done
    # Widened reads are answered from the sources' mappings by default (no
    # transform backend at all); --mapped-reads=off sends them through it.
    grep -E '"(transforms|gpu_plans|gpu_fallbacks)"' "$WORK/on/.ckptfs/stats"
    grep -qE '"gpu_plans": [1-9]' "$WORK/on/.ckptfs/stats" || { bad=$((bad+1)); echo "the --gpu=on mount ran no plan on the GPU"; }
    # The daemon's idle release: its device memory (context included) gone 2.5 s after the last read.
    echo "daemon on the GPU right after the reads: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
    sleep 2.5
    echo "daemon on the GPU 2.5 s later: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
    PATH=$G/bin:$PATH "$ck" umount "$WORK/on"; PATH=$G/bin:$PATH "$ck" umount "$WORK/off"
  else
    echo "no FUSE here (/dev/fuse $([[ -e /dev/fuse ]] && echo 'present but the mount failed' || echo absent)): compared through ckptfs cat (Filesystem::Read, as the daemon serves)"
    for f in $files; do
      n=$((n+1))
      cmp -s <("$ck" cat "$src" "$f" --gpu=on --index "$WORK/idx_on") <("$ck" cat "$src" "$f" --gpu=off --index "$WORK/idx_off") \
        || { bad=$((bad+1)); echo "DIFFERS: $f"; }
    done
  fi
  echo "$n files compared, $bad differ"
  [[ $n -gt 0 && $bad == 0 ]]
) >"$OUT/gpu_on_off.txt" 2>&1
rc=$?; summary "$([[ $rc == 0 ]] && echo PASS || echo FAIL)" "--gpu=on vs --gpu=off, $(tail -1 "$OUT/gpu_on_off.txt") (${SECONDS}s)"
rm -rf "$WORK"
! grep -q '^FAIL' "$OUT/summary.txt"
