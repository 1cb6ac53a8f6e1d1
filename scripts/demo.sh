#!/usr/bin/env bash
# The main job: install, build, mount the bundled sample checkpoint (written by
# torch.distributed.checkpoint, 2 ranks, DTensor shards) and use it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
SRC=$PWD/samples/dcp-tiny
MNT=$(mktemp -d /tmp/ckptfs-demo.XXXXXX)
trap 'build/ckptfs umount "$MNT" 2>/dev/null || true; rmdir "$MNT" 2>/dev/null || true' EXIT
set -x
build/ckptfs info "$SRC"
build/ckptfs mount "$SRC" "$MNT" --log "$MNT.log"
ls "$MNT" "$MNT/params" "$MNT/params/proj.weight"
cat "$MNT/checkpoint.json"
.venv/bin/python -c "import numpy as np; a = np.load('$MNT/params/proj.weight/param.npy'); print('proj.weight', a.shape, a.dtype, float(a.sum()))"
.venv/bin/python -c "import numpy as np; print('exp_avg_sq', np.load('$MNT/params/proj.weight/exp_avg_sq.npy')[:2])"
build/ckptfs cat "$SRC" proj.weight --format raw > "$MNT.raw"
cmp "$MNT.raw" "$MNT/params/proj.weight/param.raw" && echo "cmp: ckptfs cat and the mount agree byte for byte"
cp -r "$MNT/params" "$MNT.copy" && du -sh "$MNT.copy"
rm -rf "$MNT.copy" "$MNT.raw"
