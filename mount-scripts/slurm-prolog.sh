#!/usr/bin/env bash
# Slurm prolog: mount a checkpoint read-only on this node.
#   CKPTFS_SRC    checkpoint directory on the shared filesystem (required)
#   CKPTFS_MNT    mount point (default /tmp/ckptfs-$SLURM_JOB_ID)
#   CKPTFS_INDEX  shared index directory (default: ckptfs's default location)
# The prolog does not see the job's environment; set these in slurm.conf's
# Prolog wrapper or a site file. Build the index once before the job (e.g. in
# the submit script):
#   ckptfs index "$CKPTFS_SRC" [--index "$CKPTFS_INDEX"]
# so every node opens the same index read-only instead of building its own.
#
# slurmd runs the prolog as root, so the mount belongs to root and only
# --allow-other lets the job's user read it. Root may always pass it; a
# non-root user mounting this way needs `user_allow_other` in /etc/fuse.conf.
# mount-scripts/slurm-epilog.sh unmounts.
set -euo pipefail
# Slurm starts prologs without a search path.
export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}"
: "${CKPTFS_SRC:?set CKPTFS_SRC}"
MNT=${CKPTFS_MNT:-/tmp/ckptfs-${SLURM_JOB_ID:-$$}}
mkdir -p "$MNT"
args=(mount "$CKPTFS_SRC" "$MNT" --allow-other --log "/tmp/ckptfs-${SLURM_JOB_ID:-$$}.log")
[[ -n "${CKPTFS_INDEX:-}" ]] && args+=(--index "$CKPTFS_INDEX")
# Returns once the mount is live (the daemon detaches); a failure fails the
# prolog, and Slurm then drains the node rather than start a job without it.
ckptfs "${args[@]}"
