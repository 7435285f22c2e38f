#!/usr/bin/env bash
# The kenlm Python module compiled from its source archive with every core at once (pip builds its ~40
# files one after another: about a minute of a lent GPU host's time, against a few seconds here), for a
# machine where pip cannot fetch it: no wheel exists for most Pythons, so the archive travels instead.
#
#   bash scripts/build_kenlm_module.sh kenlm-0.3.0.tar.gz DEST_DIR    # then PYTHONPATH=DEST_DIR
#
# Needs g++ and the interpreter's headers; no Boost, no CMake (the module needs neither). Built without
# compressed-ARPA support: binary and plain ARPA models load as usual.
set -euo pipefail
archive=${1:?usage: scripts/build_kenlm_module.sh KENLM_SOURCE_TAR_GZ DEST_DIR}
dest=${2:?usage: scripts/build_kenlm_module.sh KENLM_SOURCE_TAR_GZ DEST_DIR}
py=$(command -v "${PYTHON:-python3}") || { echo "build_kenlm_module: no ${PYTHON:-python3}" >&2; exit 2; }
case "$py" in /*) ;; *) py="$PWD/$py" ;; esac
dest=$(mkdir -p "$dest" && cd "$dest" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xzf "$archive" -C "$work" --strip-components=1
include=$($py -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$($py -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
[ -r "$include/Python.h" ] || { echo "build_kenlm_module: no Python.h under $include (install the Python headers)" >&2; exit 2; }
cd "$work"
ls util/*.cc lm/*.cc util/double-conversion/*.cc python/*.cc python/kenlm.cpp | grep -v -e 'main\.cc$' -e 'test\.cc$' \
    | xargs -P "$(nproc)" -I{} g++ -c -fPIC -O3 -DNDEBUG -DKENLM_MAX_ORDER=6 -std=c++11 -DHAVE_CLOCKGETTIME \
        -I. -I"$include" {} -o {}.o
g++ -shared -o "$dest/kenlm$suffix" $(find . -name '*.o') -lstdc++ -lrt
$py -c "import sys; sys.path.insert(0, '$dest'); import kenlm; print('kenlm module built:', kenlm.__file__)"
