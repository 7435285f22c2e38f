#!/usr/bin/env bash
# End to end: sentences -> WAVs (espeak-ng) -> PocketSphinx lattices -> smallstate-lm rescore.
#
#   examples/pocketsphinx/run.sh LM_RUN_DIR [NGRAM] [SENTENCES] [WORKDIR]
#
# LM_RUN_DIR: a neural LM run directory (smallstate-lm train -o ...); NGRAM: optional KenLM ARPA/binary ("" for
# none); SENTENCES: one sentence per line (default: the first 5 of data/valid.txt); WORKDIR: default
# runs/pocketsphinx. Writes WORKDIR/wavs (WAVs + ref.txt), WORKDIR/lattices (.lat.fst, .lm.slf, words.txt,
# hyp.txt, weights.json) and WORKDIR/rescored (best.txt, nbest.jsonl, wer.txt, lattices/).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/examples/pocketsphinx"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3

if [ $# -lt 1 ]; then
  sed -n '4,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
LM="$1"
NGRAM="${2:-}"
SENTENCES="${3:-}"
WORK="${4:-$ROOT/runs/pocketsphinx}"
mkdir -p "$WORK"
if [ -z "$SENTENCES" ]; then
  SENTENCES="$WORK/sentences.txt"
  head -n 5 "$ROOT/data/valid.txt" > "$SENTENCES"
fi

"$PY" "$HERE/make_wavs.py" "$SENTENCES" -o "$WORK/wavs"
"$PY" "$HERE/decode.py" "$WORK/wavs" -o "$WORK/lattices"
ngram_args=()
[ -n "$NGRAM" ] && ngram_args=(--ngram "$NGRAM")
"$PY" -m smallstate_lm.cli rescore "$WORK"/lattices/*.lat.fst --words "$WORK/lattices/words.txt" \
  --weights "$WORK/lattices/weights.json" --lm "$LM" "${ngram_args[@]}" --refs "$WORK/wavs/ref.txt" \
  -o "$WORK/rescored"
echo "first pass (PocketSphinx): $WORK/lattices/hyp.txt; rescored: $WORK/rescored/best.txt, $WORK/rescored/wer.txt"
