# GPU inference image for `smallstate-lm serve`: one container (one uvicorn process) per GPU.
#
#   docker build -t smallstate-lm:0.1.0 .                                   # on the CUDA PyTorch base below
#   docker build --build-arg BASE=IMAGE -t smallstate-lm:0.1.0 .            # any Debian/Ubuntu base with python3 >= 3.10 and torch >= 2.1
#   docker run --gpus '"device=0"' -p 8000:8000 -v /srv/lm/model:/models/lm:ro -v /srv/lm/lm4.bin:/models/lm4.bin:ro \
#       smallstate-lm:0.1.0 --ngram /models/lm4.bin
#
# Layers, the most stable first: build tools; KenLM (lmplz, build_binary and the kenlm module, one compilation);
# the shared libraries they need; the pinned dependencies (docker/requirements.txt); the non-root user; the
# package last, so an edit to smallstate_lm/ rebuilds only its own layers. Settings: `serve` options after the
# image name, or SMALLSTATE_* variables (docs/service.md). `make docker-smoke` builds and checks it.
ARG BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

# ---- build: KenLM from the kenlm source archive on PyPI, then the package installed under /pkg
FROM ${BASE} AS build
ARG BASE
# Build arguments are environment variables of RUN and stay out of the image: pip may install beside a
# distribution's own Python (Debian's EXTERNALLY-MANAGED) and keeps no cache.
ARG PIP_BREAK_SYSTEM_PACKAGES=1
ARG PIP_NO_CACHE_DIR=1
ARG PIP_DISABLE_PIP_VERSION_CHECK=1
ARG PIP_ROOT_USER_ACTION=ignore
ARG DEBIAN_FRONTEND=noninteractive
# Fail here, before any work, on a base without torch: `pip install` would otherwise pull torch and CUDA (GBs).
RUN command -v python3 >/dev/null || { echo "error: the base image ${BASE} has no python3 (it needs python3 >= 3.10 with torch >= 2.1)"; exit 1; }; \
    python3 -c "import sys, importlib.metadata as m; v = sys.version_info; \
t = next((d.version for d in m.distributions() if (d.metadata['Name'] or '').lower() == 'torch'), None); \
ok = v >= (3, 10) and t is not None and tuple(int(x) for x in t.split('+')[0].split('.')[:2]) >= (2, 1); \
ok or print('error: the base image %s needs python3 >= 3.10 with torch >= 2.1 (--build-arg BASE=...); it has Python %s and %s' \
% (sys.argv[1], sys.version.split()[0], 'torch ' + t if t else 'no torch'), file=sys.stderr); sys.exit(0 if ok else 1)" "${BASE}"
RUN apt-get update && apt-get install -y --no-install-recommends \
        gcc g++ make cmake libboost-program-options-dev libboost-system-dev libboost-thread-dev libboost-test-dev \
        zlib1g-dev libbz2-dev liblzma-dev \
        $(python3 -c 'import os, sysconfig; p = sysconfig.get_paths()["include"]; print("" if os.path.exists(p + "/Python.h") else "python3-dev")') \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && python3 -m pip install -q "setuptools>=70.1"
# KenLM compiled once: lmplz, build_binary and the kenlm module (its CMake target, with a dist-info so pip counts
# it installed) go to /kenlm as they will lie in the image; the packages owning the shared libraries they link
# go to /kenlm.packages for the runtime stage.
ARG KENLM_VERSION=0.3.0
ARG KENLM_SHA256=c4628bb9fb63c8a6f9240035b8b037385cfc404cb72e933cf48878291edac1e8
RUN python3 -m pip download -q --no-deps --no-binary kenlm "kenlm==${KENLM_VERSION}" -d /src \
    && echo "${KENLM_SHA256}  /src/kenlm-${KENLM_VERSION}.tar.gz" | sha256sum -c --quiet \
    && mkdir /src/kenlm && tar -xzf "/src/kenlm-${KENLM_VERSION}.tar.gz" -C /src/kenlm --strip-components=1 \
    && eval "$(python3 -c 'import sysconfig as s; c = s.get_config_var; p = s.get_paths(); \
print("INC=%s LIB=%s/%s SITE=%s EXT=%s" % (p["include"], c("LIBDIR"), c("LDLIBRARY"), p["platlib"], c("EXT_SUFFIX")))')" \
    && cmake -S /src/kenlm -B /src/build -DCMAKE_BUILD_TYPE=Release -DENABLE_PYTHON=ON \
        -DPYTHON_EXECUTABLE="$(command -v python3)" -DPYTHON_INCLUDE_DIR="$INC" -DPYTHON_LIBRARY="$LIB" >/dev/null \
    && cmake --build /src/build --target lmplz build_binary kenlm_python -j"$(nproc)" >/dev/null \
    && install -D -m 755 -t /kenlm/usr/local/bin /src/build/bin/lmplz /src/build/bin/build_binary \
    && install -D -m 644 /src/build/lib/kenlm.so "/kenlm$SITE/kenlm$EXT" \
    && info="/kenlm$SITE/kenlm-${KENLM_VERSION}.dist-info" && mkdir "$info" \
    && printf 'Metadata-Version: 2.1\nName: kenlm\nVersion: %s\n' "${KENLM_VERSION}" > "$info/METADATA" \
    && echo pip > "$info/INSTALLER" \
    && printf 'kenlm%s,,\nkenlm-%s.dist-info/METADATA,,\nkenlm-%s.dist-info/INSTALLER,,\nkenlm-%s.dist-info/RECORD,,\n' \
        "$EXT" "${KENLM_VERSION}" "${KENLM_VERSION}" "${KENLM_VERSION}" > "$info/RECORD" \
    && ldd /kenlm/usr/local/bin/* "/kenlm$SITE/kenlm$EXT" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u \
        | while read -r lib; do dpkg -S "*/$(basename "$(readlink -f "$lib")")" 2>/dev/null; done | cut -d: -f1 | sort -u > /kenlm.packages \
    && PYTHONPATH="/kenlm$SITE" python3 -c "import kenlm" \
    && rm -rf /src
# the package
WORKDIR /src/app
COPY pyproject.toml README.md ./
COPY smallstate_lm ./smallstate_lm
RUN python3 -m pip install -q --no-deps --no-build-isolation --ignore-installed --no-warn-script-location --root /pkg .

# ---- runtime: the base (its torch), KenLM's shared libraries, the pinned dependencies, the package
FROM ${BASE}
ARG PIP_BREAK_SYSTEM_PACKAGES=1
ARG PIP_NO_CACHE_DIR=1
ARG PIP_DISABLE_PIP_VERSION_CHECK=1
ARG PIP_ROOT_USER_ACTION=ignore
ARG DEBIAN_FRONTEND=noninteractive
COPY --from=build /kenlm.packages /tmp/kenlm.packages
RUN missing="$(for p in $(cat /tmp/kenlm.packages); do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)" \
    && if [ -n "$missing" ]; then \
         apt-get update && apt-get install -y --no-install-recommends $missing \
         && apt-get clean && rm -rf /var/lib/apt/lists/*; fi \
    && rm /tmp/kenlm.packages
COPY --from=build /kenlm/ /
COPY docker/requirements.txt /tmp/requirements.txt
RUN python3 -m pip install -q -r /tmp/requirements.txt && rm /tmp/requirements.txt
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin smallstate
# Drain (1 s) + graceful timeout (7 s) end within the 10 s `docker stop` waits by default: a request still running
# then gets 503 and the process exits 0 instead of being killed. With `docker run --stop-timeout N` (Kubernetes:
# terminationGracePeriodSeconds) raise SMALLSTATE_GRACEFUL_TIMEOUT_S to about N - 3.
ENV PYTHONUNBUFFERED=1 \
    SMALLSTATE_HOST=0.0.0.0 \
    SMALLSTATE_PORT=8000 \
    SMALLSTATE_LM=/models/lm \
    SMALLSTATE_GRACEFUL_TIMEOUT_S=7
VOLUME ["/models"]
EXPOSE 8000
# /healthz says the process is up; orchestrators should route on /readyz (503 while loading or draining).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SMALLSTATE_PORT', '8000'), timeout=4)"]
# SIGTERM (docker stop): /readyz turns 503, in-flight requests finish, then the process exits 0.
STOPSIGNAL SIGTERM
USER smallstate
COPY --from=build /pkg/ /
ENTRYPOINT ["smallstate-lm", "serve"]
