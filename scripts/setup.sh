#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian machine: .venv with torch==2.13.0 first (a
# looser spec would pull CUDA wheels), the project with its dev extras, and KenLM's
# lmplz/build_binary built from the kenlm source archive (fetched with pip) into .venv/bin.
# A second run only checks stamps and takes seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
TORCH_VERSION="2.13.0"
KENLM_VERSION="0.3.0"
KENLM_SHA256="c4628bb9fb63c8a6f9240035b8b037385cfc404cb72e933cf48878291edac1e8"
BUILD_DIR="$ROOT/.build"

log() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x "$PY" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  log "installing torch==$TORCH_VERSION"
  "$PY" -m pip install -q "torch==$TORCH_VERSION"
fi

# Debian packages for building KenLM (and the kenlm Python module) and our compiled loops, and espeak-ng, the speech synthesiser of
# the PocketSphinx example and its test (examples/pocketsphinx).
APT_PKGS="cmake gcc g++ make libboost-program-options-dev libboost-system-dev libboost-thread-dev libboost-test-dev zlib1g-dev libbz2-dev liblzma-dev espeak-ng"
missing=""
for p in $APT_PKGS; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
  log "installing Debian packages:$missing"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

STAMP="$VENV/.smallstate-install"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  log "installing smallstate-lm with dev and hf extras"
  "$PY" -m pip install -q -e ".[dev,hf]"
  echo "$want" > "$STAMP"
fi
# bytecode for the editable install, as a wheel install would have: every command starts faster
"$PY" -m compileall -q smallstate_lm >/dev/null

if [ ! -x "$VENV/bin/lmplz" ] || [ ! -x "$VENV/bin/build_binary" ]; then
  mkdir -p "$BUILD_DIR"
  archive="$BUILD_DIR/kenlm-$KENLM_VERSION.tar.gz"
  if [ ! -f "$archive" ] || ! echo "$KENLM_SHA256  $archive" | sha256sum -c --quiet >/dev/null 2>&1; then
    # through pip's own configuration (its index, proxy and certificates); a bad archive is removed first, as pip
    # would take a file already there. --no-binary kenlm, not :all:, or pip builds the build tools (cmake) from source.
    log "fetching the kenlm $KENLM_VERSION source archive with pip"
    rm -f "$archive"
    "$PY" -m pip download -q --no-deps --no-binary kenlm "kenlm==$KENLM_VERSION" -d "$BUILD_DIR"
    echo "$KENLM_SHA256  $archive" | sha256sum -c --quiet
  fi
  log "building lmplz and build_binary (about a minute)"
  rm -rf "$BUILD_DIR/kenlm-src"
  mkdir -p "$BUILD_DIR/kenlm-src"
  tar -xzf "$archive" -C "$BUILD_DIR/kenlm-src" --strip-components=1
  blog="$BUILD_DIR/kenlm-build.log"
  if ! { cmake -S "$BUILD_DIR/kenlm-src" -B "$BUILD_DIR/kenlm-build" -DCMAKE_BUILD_TYPE=Release &&
         cmake --build "$BUILD_DIR/kenlm-build" --target lmplz build_binary -j "$(nproc)"; } >"$blog" 2>&1; then
    tail -n 30 "$blog" >&2
    log "building KenLM failed; full log in $blog"
    exit 1
  fi
  install -m 755 "$BUILD_DIR/kenlm-build/bin/lmplz" "$BUILD_DIR/kenlm-build/bin/build_binary" "$VENV/bin/"
fi

log "ready: $VENV"
