#!/usr/bin/env bash
# Build the Docker image and check it as a deployment uses it (`make docker-smoke`; CI runs it after the tests):
# a KenLM n-gram built inside the container, the service started with the shipped model mounted at /models/lm,
# /readyz, /rescore (an n-best list and a lattice), a session, /score, /metrics, a 4xx, the health status, one clear line
# and a non-zero exit for bad deployment input (no model, a corrupt model, an unreadable n-gram, a port in use),
# and `docker stop` answering the request in flight and exiting 0 within the grace time. It removes the
# containers and files it made (the images stay, so the next run builds from cache) and reports each step's time
# and the image size.
#
#   scripts/docker_smoke.sh
#   BASE=IMAGE        build on IMAGE (python3 >= 3.10 with torch) instead of the local base that
#                     scripts/make_base_image.sh makes (debootstrap + Python 3.11 + the CPU torch wheel) or reuses
#   IMAGE=TAG         the tag to build (smallstate-lm:smoke)
#   RUN_ARGS="..."    extra `docker run` arguments for the service, e.g. "--gpus device=0" on a GPU host
#   STOP_GRACE=10     seconds `docker stop` may wait (docker's default)
set -Eeuo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
IMAGE="${IMAGE:-smallstate-lm:smoke}"
RUN_ARGS="${RUN_ARGS:-}"
STOP_GRACE="${STOP_GRACE:-10}"
MODEL="$ROOT/models/bible-small"
TMP="$(mktemp -d /tmp/smallstate-smoke.XXXXXX)"
NAME="smallstate-smoke-$$"
CONTAINERS=()
REPORT=()
STEP="start"
T_START=$EPOCHREALTIME

log() { printf '[smoke] %s\n' "$*" >&2; }
fail() { log "FAIL ($STEP): $*"; exit 1; }
cleanup() {
  local c
  for c in "${CONTAINERS[@]}"; do docker rm -f -v "$c" >/dev/null 2>&1 || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT
trap 'log "FAIL ($STEP): command failed at line $LINENO"' ERR
elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
# step NAME FUNCTION: run one step, time it, keep the line for the report
step() {
  STEP="$1"
  local t0=$EPOCHREALTIME
  "$2"
  REPORT+=("$(printf '%-48s %7s s' "$1" "$(elapsed "$t0")")")
  log "ok: $1 ($(elapsed "$t0") s)"
}
# check FILE PYTHON-EXPRESSION WHAT: the JSON in FILE (as d) satisfies the expression
check() {
  python3 - "$1" "$2" <<'EOF' || fail "$3: $(head -c 600 "$1")"
import json, math, sys
d = json.load(open(sys.argv[1]))
finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)
sys.exit(0 if eval(sys.argv[2]) else 1)
EOF
}
# post PATH BODY-FILE OUT-FILE: prints the HTTP status
post() { curl -s -o "$3" -w '%{http_code}' -m 60 -H 'Content-Type: application/json' --data-binary "@$2" "$URL$1" || true; }

# ---- steps
command -v docker >/dev/null || fail "docker is not installed"
docker info >/dev/null 2>&1 || fail "cannot reach dockerd (is it running? are you in the docker group?)"
[ -f "$MODEL/model.pt" ] || fail "no shipped model at $MODEL"

make_base() {
  if [ -z "${BASE:-}" ]; then
    BASE="$(bash scripts/make_base_image.sh)"
  fi
  log "base image: $BASE"
}

build() {
  # BuildKit where the buildx plugin is there (docker >= 23 needs it for BuildKit), else the legacy builder
  local builder=legacy old
  if docker buildx version >/dev/null 2>&1; then builder=buildkit; fi
  old="$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
  log "docker build ($builder builder) --build-arg BASE=$BASE -t $IMAGE"
  if ! if [ "$builder" = buildkit ]; then
         DOCKER_BUILDKIT=1 docker build --progress=plain --build-arg BASE="$BASE" -t "$IMAGE" . ;
       else
         DOCKER_BUILDKIT=0 docker build --force-rm --build-arg BASE="$BASE" -t "$IMAGE" . ;
       fi >"$TMP/build.log" 2>&1; then
    tail -n 40 "$TMP/build.log" >&2
    fail "docker build failed (the end of its log is above)"
  fi
  local steps cached
  if [ "$builder" = legacy ]; then
    # the steps that ran (not from the cache), FROM and the global ARG aside
    awk '/^Step [0-9]+\/[0-9]+ : /{ if (s && !c && s !~ / : (FROM|ARG BASE=)/) print s; s = $0; c = 0; next }
         /Using cache/{ c = 1 } END{ if (s && !c && s !~ / : (FROM|ARG BASE=)/) print s }' "$TMP/build.log" >"$TMP/ran"
    steps="$(grep -c '^Step [0-9]*/' "$TMP/build.log" || true)"
    BUILD_CACHE="$(wc -l <"$TMP/ran") of $steps steps ran, the others came from the cache"
    [ "$(wc -l <"$TMP/ran")" -gt 8 ] || sed 's/^/[smoke]   ran: /' "$TMP/ran" | cut -c1-110 >&2
  else
    steps="$(grep -c '^#[0-9]* \[' "$TMP/build.log" || true)"; cached="$(grep -c '^#[0-9]* CACHED' "$TMP/build.log" || true)"
    BUILD_CACHE="$cached of $steps steps from the cache"
  fi
  log "$BUILD_CACHE"
  local new; new="$(docker image inspect -f '{{.Id}}' "$IMAGE")"
  if [ -n "$old" ] && [ "$old" != "$new" ]; then docker rmi "$old" >/dev/null 2>&1 || true; fi
}

ngram() {
  # the image's lmplz and build_binary, as its user, on the bundled training text
  mkdir -p "$TMP/ngram" && chmod 777 "$TMP/ngram"
  CONTAINERS+=("$NAME-ngram")
  docker run --rm --name "$NAME-ngram" --entrypoint smallstate-lm -v "$ROOT/data:/data:ro" -v "$TMP/ngram:/out" \
    "$IMAGE" ngram train --order 3 --text /data/train.txt -o /out/lm3.arpa --binary /out/lm3.bin \
    >"$TMP/ngram.log" 2>&1 || { tail -n 20 "$TMP/ngram.log" >&2; fail "ngram train in the container failed"; }
  [ -s "$TMP/ngram/lm3.bin" ] || fail "no lm3.bin written"
}

hf_lm() {
  # the hf extra in the image: a small GPT-2 made there (tokenizer trained on the bundled text, random
  # weights), then `eval --model hf:DIR` on the dev text, as the image's user
  mkdir -p "$TMP/hf" && chmod 777 "$TMP/hf"
  CONTAINERS+=("$NAME-hf")
  docker run --rm --name "$NAME-hf" --entrypoint python3 -v "$ROOT/scripts:/scripts:ro" -v "$ROOT/data:/data:ro" \
    -v "$TMP/hf:/out" "$IMAGE" /scripts/make_hf_model.py --arch gpt2 --text /data/train.txt --lines 2000 \
    --vocab-size 300 --d-model 32 -o /out/gpt2 >"$TMP/hf.log" 2>&1 \
    || { tail -n 20 "$TMP/hf.log" >&2; fail "making a Hugging Face model in the container failed"; }
  docker run --rm --name "$NAME-hf" --entrypoint smallstate-lm -v "$TMP/hf/gpt2:/hf:ro" -v "$ROOT/data:/data:ro" \
    "$IMAGE" eval --model hf:/hf --text /data/dev.txt >"$TMP/hf.log" 2>&1 \
    || { tail -n 20 "$TMP/hf.log" >&2; fail "eval --model hf:DIR in the container failed"; }
  grep -q '^perplexity' "$TMP/hf.log" || fail "eval --model hf:DIR printed no perplexity"
}

start() {
  CONTAINERS+=("$NAME")
  # shellcheck disable=SC2086
  docker run -d --name "$NAME" -p 127.0.0.1::8000 $RUN_ARGS \
    -v "$MODEL:/models/lm:ro" -v "$TMP/ngram/lm3.bin:/models/lm3.bin:ro" \
    -v "$ROOT/lattices/weights.json:/models/weights.json:ro" -e SMALLSTATE_WEIGHTS=/models/weights.json \
    "$IMAGE" --ngram /models/lm3.bin >/dev/null
  URL="http://$(docker port "$NAME" 8000/tcp | head -n1)"
  log "service at $URL"
}

ready() {
  local deadline=$((SECONDS + 300)) code
  while :; do
    code="$(curl -s -o /dev/null -w '%{http_code}' -m 5 "$URL/readyz" || true)"
    [ "$code" = 200 ] && break
    if [ "$(docker inspect -f '{{.State.Running}}' "$NAME")" != true ]; then
      docker logs --tail 20 "$NAME" >&2; fail "the container exited before it was ready"
    fi
    [ $SECONDS -lt $deadline ] || { docker logs --tail 20 "$NAME" >&2; fail "/readyz not 200 after 300 s"; }
    sleep 0.5
  done
}

rescore_nbest() {
  cat >"$TMP/nbest.json" <<'EOF'
{"utterances": [{"id": "u1", "hypotheses": [
  {"text": "he is a double minded man unstable in all his ways", "am_score": -612.0, "graph_score": -72.1},
  {"text": "he is a double minded man and stable and all his ways", "am_score": -610.5, "graph_score": -74.3}]}]}
EOF
  local code; code="$(post /rescore "$TMP/nbest.json" "$TMP/out.json")"
  [ "$code" = 200 ] || fail "/rescore (n-best) answered $code: $(head -c 400 "$TMP/out.json")"
  check "$TMP/out.json" "[h['rank'] for h in d['utterances'][0]['hypotheses']] == [0, 1] and all(finite(h['neural']) \
and finite(h['ngram']) and finite(h['total']) for h in d['utterances'][0]['hypotheses'])" "/rescore (n-best)"
  # the weights of SMALLSTATE_WEIGHTS (lattices/weights.json) are the defaults
  check "$TMP/out.json" "d['weights']['am_scale'] == 0.10526 and d['weights']['word_penalty'] == -0.25" \
    "/rescore (n-best): not the weights of SMALLSTATE_WEIGHTS"
  log "  best: $(python3 -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1]))["utterances"][0]["best"]["words"]))' "$TMP/out.json")"
}

rescore_lattice() {
  local utt=slt-dev0004
  gunzip -c "lattices/$utt.lm.slf.gz" | python3 -c 'import json, sys
print(json.dumps({"utterances": [{"id": sys.argv[1], "lattice": {"format": "htk-slf", "data": sys.stdin.read()}}], "nbest": 3}))' \
    "$utt" >"$TMP/lattice.json"
  local code; code="$(post /rescore "$TMP/lattice.json" "$TMP/out.json")"
  [ "$code" = 200 ] || fail "/rescore (lattice) answered $code: $(head -c 400 "$TMP/out.json")"
  check "$TMP/out.json" "d['utterances'][0]['best']['words'] and all(finite(h['neural']) and finite(h['ngram']) \
for h in d['utterances'][0]['hypotheses'])" "/rescore (lattice)"
  log "  best: $(python3 -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1]))["utterances"][0]["best"]["words"]))' "$TMP/out.json")"
  log "  ref:  $(grep "^$utt " lattices/ref.txt | cut -d' ' -f2-)"
}

session() {
  echo '{"id": "smoke", "context_utts": 1}' >"$TMP/session.json"
  local code; code="$(post /v1/sessions "$TMP/session.json" "$TMP/out.json")"
  [ "$code" = 201 ] || fail "POST /v1/sessions answered $code: $(head -c 400 "$TMP/out.json")"
  local utt
  for utt in slt-dev0000 slt-dev0004; do  # two consecutive utterances of the session, the second after the first
    gunzip -c "lattices/$utt.lm.slf.gz" | python3 -c 'import json, sys
print(json.dumps({"session": "smoke", "utterances": [{"id": sys.argv[1], "lattice": {"format": "htk-slf", "data": sys.stdin.read()}}]}))' \
      "$utt" >"$TMP/session-lattice.json"
    code="$(post /rescore "$TMP/session-lattice.json" "$TMP/out.json")"
    [ "$code" = 200 ] || fail "/rescore (session) answered $code: $(head -c 400 "$TMP/out.json")"
  done
  curl -sS -m 10 -o "$TMP/out.json" "$URL/v1/sessions/smoke" || fail "GET /v1/sessions/smoke did not answer"
  check "$TMP/out.json" "d['context_utts'] == 1 and len(d['transcripts']) == 1" "GET /v1/sessions/smoke"
  code="$(curl -s -o /dev/null -w '%{http_code}' -m 10 -X DELETE "$URL/v1/sessions/smoke" || true)"
  [ "$code" = 204 ] || fail "DELETE /v1/sessions/smoke answered $code"
  code="$(post /rescore "$TMP/session-lattice.json" "$TMP/out.json")"
  [ "$code" = 404 ] || fail "/rescore of a deleted session answered $code, expected 404"
}

score() {
  echo '{"sentences": ["the lord said", "and he said unto them"]}' >"$TMP/score.json"
  local code; code="$(post /score "$TMP/score.json" "$TMP/out.json")"
  [ "$code" = 200 ] || fail "/score answered $code: $(head -c 400 "$TMP/out.json")"
  check "$TMP/out.json" "len(d['sentences']) == 2 and all(finite(v['logprob']) for s in d['sentences'] \
for v in s.values() if isinstance(v, dict) and 'logprob' in v)" "/score"
}

metrics() {
  curl -sS -m 10 -o "$TMP/metrics.txt" "$URL/metrics" || fail "/metrics did not answer"
  grep -q '^smallstate_requests_total{.*route="/rescore".*status="200"' "$TMP/metrics.txt" \
    || fail "/metrics has no smallstate_requests_total for /rescore 200"
  grep -q '^smallstate_ready 1' "$TMP/metrics.txt" || fail "/metrics: smallstate_ready is not 1"
}

bad_request() {
  echo '{"utterances": [{"id": "u1"}]}' >"$TMP/bad.json"
  local code; code="$(post /rescore "$TMP/bad.json" "$TMP/out.json")"
  [ "$code" = 422 ] || fail "a request without hypotheses or lattice answered $code, not 422"
  printf '{"utterances": [' >"$TMP/bad.json"
  code="$(post /rescore "$TMP/bad.json" "$TMP/out.json")"
  [ "$code" = 400 ] || fail "malformed JSON answered $code, not 400"
}

healthy() {
  # the image's HEALTHCHECK (every 15 s)
  local deadline=$((SECONDS + 90)) status
  while :; do
    status="$(docker inspect -f '{{.State.Health.Status}}' "$NAME")"
    [ "$status" = healthy ] && break
    [ "$status" != unhealthy ] || fail "the container is unhealthy"
    [ $SECONDS -lt $deadline ] || fail "health status still '$status' after 90 s"
    sleep 1
  done
}

# bad_start WHAT PATTERN DOCKER-RUN-ARGS...: the service must exit non-zero with one line that says why
bad_start() {
  local what="$1" pattern="$2" rc=0 line
  shift 2
  CONTAINERS+=("$NAME-bad")
  timeout 180 docker run --rm --name "$NAME-bad" "$@" >"$TMP/bad.log" 2>&1 || rc=$?
  [ "$rc" -ne 0 ] || fail "$what: the service started (exit 0)"
  [ "$rc" -ne 124 ] || fail "$what: still running after 180 s"
  # one line, ours: `error: ...` naming what is wrong (no usage text, no log lines, no traceback)
  line="$(grep -v '^[[:space:]]*$' "$TMP/bad.log" || true)"
  [ "$(printf '%s\n' "$line" | wc -l)" -eq 1 ] && printf '%s' "$line" | grep -qE "^error: .*$pattern" \
    || { tail -n 15 "$TMP/bad.log" >&2; fail "$what: not one line 'error: ...$pattern...' (output above)"; }
  log "  $what: exit $rc: ${line:0:200}"
}
bad_inputs() {
  mkdir -p "$TMP/corrupt"
  head -c 4096 "$MODEL/model.pt" >"$TMP/corrupt/model.pt"
  cp "$MODEL/vocab.txt" "$TMP/corrupt/"
  cp "$TMP/ngram/lm3.bin" "$TMP/unreadable.bin" && chmod 000 "$TMP/unreadable.bin"
  bad_start "no model mounted" "/models/lm" "$IMAGE"
  bad_start "corrupt model" "model.pt" -v "$TMP/corrupt:/models/lm:ro" "$IMAGE"
  bad_start "unreadable n-gram" "ngram.bin" -e SMALLSTATE_LM= -v "$TMP/unreadable.bin:/models/ngram.bin:ro" \
    "$IMAGE" --ngram /models/ngram.bin
  # a second service in the first one's network namespace: its port 8000 is taken
  bad_start "port in use" "--port 8000.*cannot listen there" --network "container:$NAME" -v "$MODEL:/models/lm:ro" "$IMAGE"
}

stop() {
  # a lattice request in flight when SIGTERM comes still gets its answer; then the process exits 0
  curl -sS -o "$TMP/inflight.json" -w '%{http_code}' -m 30 -H 'Content-Type: application/json' \
    --data-binary "@$TMP/lattice.json" "$URL/rescore" >"$TMP/inflight.code" 2>/dev/null &
  local pid=$! t0 dt code rc
  sleep 0.05
  t0=$EPOCHREALTIME
  docker stop -t "$STOP_GRACE" "$NAME" >/dev/null
  dt="$(elapsed "$t0")"
  wait "$pid" || true
  code="$(cat "$TMP/inflight.code")"
  rc="$(docker inspect -f '{{.State.ExitCode}}' "$NAME")"
  [ "$rc" = 0 ] || { docker logs --tail 20 "$NAME" >&2; fail "exit status $rc after docker stop"; }
  awk -v d="$dt" -v g="$STOP_GRACE" 'BEGIN { exit !(d < g) }' || fail "docker stop took $dt s (grace $STOP_GRACE s): killed"
  [ "$code" = 200 ] || fail "the request in flight at SIGTERM got $code, not 200"
  log "  exit 0 after $dt s; the request in flight got 200"
}

start_ready() { start; ready; }

step "base image" make_base
step "docker build" build
step "n-gram in the container (lmplz, build_binary)" ngram
step "a Hugging Face LM in the container (eval --model hf:DIR)" hf_lm
step "service start, until /readyz is 200" start_ready
step "/rescore, n-best list" rescore_nbest
step "/rescore, lattice (HTK SLF)" rescore_lattice
step "a session: two lattices in turn, then deleted" session
step "/score" score
step "bad requests: 422, 400" bad_request
step "/metrics" metrics
step "health status: healthy" healthy
step "bad deployment input: one line, exit != 0" bad_inputs
step "docker stop (SIGTERM drain), exit 0" stop
STEP="report"

size="$(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{ printf "%.2f GB", $1 / 1e9 }')"
base_size="$(docker image inspect -f '{{.Size}}' "$BASE" | awk '{ printf "%.2f GB", $1 / 1e9 }')"
{
  echo "[smoke] passed: $IMAGE on $BASE"
  printf '  %s\n' "${REPORT[@]}"
  printf '  %-48s %7s s\n' "total" "$(elapsed "$T_START")"
  echo "  image $IMAGE: $size (base $BASE: $base_size); build: $BUILD_CACHE"
} >&2
