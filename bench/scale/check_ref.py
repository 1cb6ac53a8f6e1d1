"""Compares every key of a reference npz (paths relative to a ckptfs mount root,
as make_megatron_scale.py --ref writes them) with what the mount serves:
dtype, shape and every value exactly. Exit status 1 on any mismatch.

    python bench/scale/check_ref.py MOUNT REF.npz
"""
import os
import sys

import numpy as np


def main():
    mount, ref_path = sys.argv[1], sys.argv[2]
    ref = np.load(ref_path)
    bad = 0
    for key in sorted(ref.files):
        want = ref[key]
        try:
            got = np.load(os.path.join(mount, key))
        except OSError as e:
            print(f"FAIL {key}: {e}")
            bad += 1
            continue
        if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
            print(f"FAIL {key}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
            bad += 1
        else:
            print(f"ok   {key} {list(got.shape)}")
    print(f"{len(ref.files) - bad}/{len(ref.files)} equal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
