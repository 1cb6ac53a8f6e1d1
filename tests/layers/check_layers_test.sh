#!/usr/bin/env bash
# The layer rules (cmake/CheckLayers.cmake) accept the tree as it is and
# refuse each kind of wrong include: a family header in src/views or
# src/verify, views in src/io, the index in src/formats, RocksDB outside
# src/index. Run by ctest (LayerRules).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
check() { cmake -DROOT="$1" -P "$root/cmake/CheckLayers.cmake" >"$work/out" 2>&1; }

cp -r "$root/src" "$work/src"
check "$work" || { cat "$work/out"; echo "FAIL: the tree as it is breaks the layer rules"; exit 1; }

refuse() {  # file include expected-text
  rm -rf "$work/src" && cp -r "$root/src" "$work/src"
  sed -i "1a #include $2" "$work/src/$1"
  if check "$work"; then echo "FAIL: $1 including $2 passed the check"; exit 1; fi
  grep -qF "$3" "$work/out" || { cat "$work/out"; echo "FAIL: no '$3' in the message"; exit 1; }
  echo "refused: $1 including $2"
}
refuse views/view.cc '"formats/megatron/megatron_common.h"' 'src/views/view.cc: #include "formats/megatron/megatron_common.h" (the views layer'
refuse verify/verify.cc '"formats/deepspeed/ds_reader.h"' 'the verify layer may not include that'
refuse io/engine.cc '"ckptfs/views.h"' 'the io layer may not include that'
refuse formats/npy.cc '"ckptfs/index.h"' 'the formats layer may not include that'
refuse views/view.cc '<rocksdb/db.h>' 'only src/index may include it'
echo "layer rules: ok"
