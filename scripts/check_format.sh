#!/usr/bin/env bash
# Style check: clang-format (the repository's .clang-format) over every C++ and
# CUDA source; fails on a diff and prints it. --fix rewrites the files instead.
set -euo pipefail
cd "$(dirname "$0")/.."
CF=${CLANG_FORMAT:-clang-format}
command -v "$CF" >/dev/null || { echo "check_format: $CF not found (apt-get install clang-format)"; exit 1; }
mapfile -t files < <(git ls-files --cached --others --exclude-standard -- \
  'src/*.cc' 'src/*.h' 'src/*.cu' 'include/*.h' 'tests/*.cc' 'tests/*.h' 'bench/*.cc' 'bench/*.h')
if [[ "${1:-}" == "--fix" ]]; then
  "$CF" -i --style=file "${files[@]}"
  exit 0
fi
bad=0
for f in "${files[@]}"; do
  [[ -f "$f" ]] || continue
  if ! out=$("$CF" --style=file "$f" | diff -u "$f" - --label "$f" --label "$f (clang-format)"); then
    echo "$out"
    bad=$((bad + 1))
  fi
done
if ((bad)); then
  echo "check_format: $bad of ${#files[@]} files differ from clang-format ($("$CF" --version)); scripts/check_format.sh --fix rewrites them"
  exit 1
fi
echo "check_format: ${#files[@]} files match clang-format"
