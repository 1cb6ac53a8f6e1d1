#!/usr/bin/env bash
# Slurm prolog: mount a checkpoint read-only on this node.
#   CKPTFS_SRC    checkpoint directory on the shared filesystem (required)
#   CKPTFS_MNT    mount point (default /tmp/ckptfs-$SLURM_JOB_ID)
#   CKPTFS_INDEX  shared index directory (default: ckptfs's default location)
# Build the index once before the job (e.g. in the submit script):
#   ckptfs index "$CKPTFS_SRC" [--index "$CKPTFS_INDEX"]
# so every node opens the same index read-only instead of building its own.
set -euo pipefail
: "${CKPTFS_SRC:?set CKPTFS_SRC}"
MNT=${CKPTFS_MNT:-/tmp/ckptfs-${SLURM_JOB_ID:-$$}}
mkdir -p "$MNT"
args=(mount "$CKPTFS_SRC" "$MNT" --log "/tmp/ckptfs-${SLURM_JOB_ID:-$$}.log")
[[ -n "${CKPTFS_INDEX:-}" ]] && args+=(--index "$CKPTFS_INDEX")
ckptfs "${args[@]}"
