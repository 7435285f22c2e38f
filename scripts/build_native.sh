#!/usr/bin/env bash
# Build the compiled loops of lattice rescoring (smallstate_lm/rescoring/_native.c -> _native.so: plain C99,
# loaded with ctypes). The library carries the SHA-1 of its source, so a stale build is never used.
#   scripts/build_native.sh [SOURCE.c [OUTPUT.so]]
set -euo pipefail
SRC="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/smallstate_lm/rescoring/_native.c}"
OUT="${2:-${SRC%.c}.so}"
SHA="$(sha1sum "$SRC" | cut -d' ' -f1)"
"${CC:-cc}" -O2 -std=c99 -Wall -Wextra -shared -fPIC -DSSL_SOURCE_SHA1="\"$SHA\"" -o "$OUT.tmp" "$SRC" -lm
mv -f "$OUT.tmp" "$OUT"
