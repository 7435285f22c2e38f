#!/usr/bin/env bash
# The GPU run behind docs/results.md "state-tradeoff": the whole family trained at once on one
# GPU (7 runs share it), then its weights packed as int8 parts under OUT_DIR for the trip back
# (a lent GPU host returns at most 64 MiB). FAMILY, TOKENS, MINUTES, JOBS, RUNS override the
# defaults (on one H100, 7 members of 22M tokens each took 5 minutes). Assessment runs on the CPU:
#   python scripts/state_tradeoff.py unpack OUT_DIR/tradeoff.tar.* && python scripts/state_tradeoff.py assess ...
set -uo pipefail
out=${1:?usage: scripts/state_tradeoff_gpu.sh OUT_DIR [TEXT_DIR with train.txt valid.txt dev.txt]}
text=${2:-gpu_data}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null || true
runs=${RUNS:-runs/tradeoff}
$py scripts/state_tradeoff.py train --runs "$runs" --family "${FAMILY:-7x1,4x2,3x3,2x5,7x1kv,4x2kv,3x3kv}" \
    --train "$text/train.txt" --valid "$text/valid.txt" \
    --dev "$text/dev.txt" --jobs "${JOBS:-7}" --threads 2 --device "${DEVICE:-cuda}" \
    --max-tokens "${TOKENS:-22e6}" --max-minutes "${MINUTES:-7}"
status=$?
$py scripts/state_tradeoff.py pack --runs "$runs" --out "$out" || status=$?
exit $status
