#!/usr/bin/env bash
# Slurm epilog: unmount what mount-scripts/slurm-prolog.sh mounted (same
# CKPTFS_MNT), lazily when a leftover process of the job still holds it.
set -u
# Slurm starts epilogs without a search path.
export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}"
MNT=${CKPTFS_MNT:-/tmp/ckptfs-${SLURM_JOB_ID:-$$}}

# From /proc/mounts rather than mountpoint(1): a dead FUSE mount (its daemon
# gone) fails stat with ENOTCONN and would look unmounted, yet still needs
# unmounting. Paths with spaces appear there octal-escaped; the default MNT
# has none.
mounted() { awk -v m="$1" '$2 == m { found = 1 } END { exit !found }' /proc/mounts; }

if mounted "$MNT"; then
  # Plain unmount first; when busy, detach now and let the kernel finish once
  # the last file is closed (--lazy, else fusermount3 -uz for a ckptfs
  # without it).
  ckptfs umount "$MNT" 2>/dev/null || ckptfs umount --lazy "$MNT" 2>/dev/null || fusermount3 -uz "$MNT"
fi
rmdir "$MNT" 2>/dev/null || true
# An epilog's failure drains the node; report one only when the mount stayed.
! mounted "$MNT"
