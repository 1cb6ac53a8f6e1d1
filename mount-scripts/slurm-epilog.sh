#!/usr/bin/env bash
# Slurm epilog: unmount what the prolog mounted (lazy unmount if still busy).
set -u
MNT=${CKPTFS_MNT:-/tmp/ckptfs-${SLURM_JOB_ID:-$$}}
if mountpoint -q "$MNT"; then
  ckptfs umount "$MNT" || fusermount3 -uz "$MNT"
fi
rmdir "$MNT" 2>/dev/null || true
