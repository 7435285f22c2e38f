#!/usr/bin/env bash
# The project's GPU check, in about 8 minutes on one GPU: the CUDA tests, then bench_forward, bench_nbest,
# bench_lattice --breakdown, bench_service, bench_inference_precision, bench_service in bf16 and
# bench_service --abuse on the device, every table and log written under OUT_DIR (a copy of docs/benchmarks.md with the device's
# sections rewritten, plus one log per step). Run it whenever a GPU is available; CI has none.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR [--device cuda] [--data DIR] [--ngram FILE] [--lattices DIR]
#
#   --data      the dev data (DIR/dev/festival_{slt,kal}/nbest.tsv, DIR/dev/words.txt); default ../shared/data
#   --ngram     the KenLM model for lattices and the service; default runs/lm4.bin (the full-text 4-gram)
#   --lattices  the lattices of the breakdown: *.lat.fst there, words.txt beside them or DIR/../words.txt;
#               default: the first 60 slt and 30 kal dev lattices of --data, read in place
#   --device    cuda (default) or cpu: the same steps on the CPU, to check the suite itself
#
# Each step has its own time limit and the suite goes on after a failed one; the exit status says
# whether every step passed. Without kenlm the lattice and service steps are skipped, said so in
# OUT_DIR/summary.txt.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_suite.sh OUT_DIR [--device cuda|cpu] [--data DIR] [--ngram FILE] [--lattices DIR]}
shift
device=cuda data=../shared/data ngram=runs/lm4.bin lattices=
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device=$2; shift 2 ;;
        --data) data=$2; shift 2 ;;
        --ngram) ngram=$2; shift 2 ;;
        --lattices) lattices=$2; shift 2 ;;
        *) echo "gpu_suite: unknown option $1" >&2; exit 2 ;;
    esac
done
cd "$(dirname "$0")/.." || exit 2
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONUNBUFFERED=1
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
doc="$out/benchmarks.md"
cp docs/benchmarks.md "$doc" || exit 2
summary="$out/summary.txt"
: > "$summary"
failed=0

nbest=("$data"/dev/festival_slt/nbest.tsv "$data"/dev/festival_kal/nbest.tsv)
for f in "${nbest[@]}"; do
    [ -r "$f" ] || { echo "gpu_suite: $f: cannot be read (--data DIR with dev/festival_{slt,kal}/nbest.tsv)" >&2; exit 2; }
done
if [ -z "$lattices" ]; then
    lattices="$out/lattices"
    mkdir -p "$lattices"
    for voice in slt:60 kal:30; do
        name=${voice%%:*} n=${voice##*:}
        for f in $(ls "$data/dev/festival_$name/fst/"*.lat.fst | head -n "$n"); do
            ln -sf "$(cd "$(dirname "$f")" && pwd)/$(basename "$f")" "$lattices/$name-$(basename "$f")"
        done
    done
    ln -sf "$(cd "$data/dev" && pwd)/words.txt" "$lattices/words.txt"
fi
words="$lattices/words.txt"
[ -r "$words" ] || words="$lattices/../words.txt"

# The limits are a GPU's; the CPU (a check of the suite itself) gets five times as long.
scale=1
[ "$device" = cpu ] && scale=5

step() {  # step NAME SECONDS COMMAND...: run it with a limit, its output in OUT/NAME.log, its verdict in summary
    local name=$1 limit=$(( $2 * scale )) t0 rc cmd="$*"
    shift 2
    t0=$(date +%s)
    [ ${#cmd} -gt 300 ] && cmd="${cmd:0:300} ..."
    echo "== $name: ${cmd#* * }" | tee -a "$summary"
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    local verdict="ok"
    [ $rc -eq 124 ] && verdict="TIMED OUT after ${limit} s"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && verdict="FAILED (exit $rc)"
    [ $rc -ne 0 ] && failed=1
    echo "   $verdict in $(( $(date +%s) - t0 )) s; last lines:" | tee -a "$summary"
    tail -n 3 "$out/$name.log" | sed 's/^/   | /' | tee -a "$summary"
}

{
    echo "gpu_suite on $(hostname) at $(date -u +%FT%TZ), device $device"
    $py -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
    nvidia-smi -L 2>/dev/null || true
} 2>&1 | tee -a "$summary"

concurrency=32  # the GPU target's; two CPU cores saturate at 8 (beyond it admission answers 503)
[ "$device" = cpu ] && concurrency=8
if [ "$device" = cpu ]; then
    step test_cuda 60 env SMALLSTATE_TEST_DEVICE=cpu $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
else
    step test_cuda 120 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
fi
step bench_forward 45 $py benchmarks/bench_forward.py --device "$device" --repeats 5 --doc "$doc"
step bench_nbest 75 $py benchmarks/bench_nbest.py --device "$device" --nbest "${nbest[@]}" --doc "$doc"
if $py -c "import kenlm" 2>/dev/null && [ -r "$ngram" ]; then
    step bench_lattice 75 $py benchmarks/bench_lattice.py --breakdown --device "$device" --lm models/bible-small \
        --ngram "$ngram" --lattices "$lattices"/*.lat.fst --words "$words" --weights lattices/weights.json --doc "$doc"
    step bench_service 150 $py benchmarks/bench_service.py --device "$device" --lm models/bible-small \
        --ngram "$ngram" --nbest "${nbest[@]}" --concurrency 1 "$concurrency" --seconds 5 --doc "$doc"
    # reduced precision: speed, agreement with fp32 and dev WER (n-best lists, and the dev lattices of
    # DATA/dev/festival_*/fst when they are there); then the service in bf16 at the top concurrency
    step bench_precision 150 $py benchmarks/bench_inference_precision.py --device "$device" --lm models/bible-small \
        --ngram "$ngram" --data "$data" --doc "$doc"
    step bench_service_bf16 90 $py benchmarks/bench_service.py --device "$device" --precision bf16 \
        --lm models/bible-small --ngram "$ngram" --nbest "${nbest[@]}" --concurrency "$concurrency" --seconds 5 \
        --doc "$doc"
    # the service under abuse (near-limit packs, wedges, stalls, hang-ups, SIGTERM), at the limits the CPU
    # rows of docs/benchmarks.md were measured with; the numbers also in abuse.json. Its lattice packs are
    # the dev lattices of DATA/dev/festival_*/fst.
    if ls "$data"/dev/festival_*/fst/*.lat.fst > /dev/null 2>&1; then
        step bench_abuse 240 $py benchmarks/bench_service.py --abuse --device "$device" --lm models/bible-small \
            --ngram "$ngram" --nbest "${nbest[@]}" --dev "$data/dev" --set max_trie_nodes=200000 \
            --set max_lattice_cost=2000000 --set header_timeout_s=10 --set body_timeout_s=30 --doc "$doc" \
            --json "$out/abuse.json"
    else
        echo "== bench_abuse: SKIPPED (its lattice packs need $data/dev/festival_*/fst/*.lat.fst)" | tee -a "$summary"
        failed=1
    fi
else
    echo "== bench_lattice, bench_service: SKIPPED (needs the kenlm module and a readable --ngram $ngram)" \
        | tee -a "$summary"
    failed=1
fi
echo "gpu_suite: $( [ $failed -eq 0 ] && echo 'every step passed' || echo 'some steps failed or were skipped' );" \
     "tables in $doc, logs in $out" | tee -a "$summary"
exit $failed
