# syntax=docker/dockerfile:1
# GPU inference image for `smallstate-lm serve`: one container (one uvicorn process) per GPU.
#
#   docker build -t smallstate-lm:0.1.0 .
#   docker run --gpus '"device=0"' -p 8000:8000 -v "$PWD:/work:ro" smallstate-lm:0.1.0 \
#       --lm /work/models/bible-small --ngram /work/runs/demo/lm4.bin
#
# Settings: the `serve` options after the image name, or SMALLSTATE_* variables (docs/service.md).
ARG BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

# ---- build: KenLM's lmplz/build_binary and the kenlm Python module, from the kenlm sdist on PyPI
FROM ${BASE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends \
        build-essential cmake libboost-program-options-dev libboost-system-dev libboost-thread-dev \
        libboost-test-dev zlib1g-dev libbz2-dev liblzma-dev \
    && rm -rf /var/lib/apt/lists/*
ARG KENLM_VERSION=0.3.0
RUN pip download --no-deps --no-binary :all: "kenlm==${KENLM_VERSION}" -d /src \
    && mkdir /src/kenlm && tar -xzf "/src/kenlm-${KENLM_VERSION}.tar.gz" -C /src/kenlm --strip-components=1 \
    && cmake -S /src/kenlm -B /src/build -DCMAKE_BUILD_TYPE=Release \
    && cmake --build /src/build --target lmplz build_binary -j"$(nproc)" \
    && pip wheel --no-deps -w /wheels "/src/kenlm-${KENLM_VERSION}.tar.gz"
# the compiled loops of lattice rescoring (k-best, FST records, searches)
COPY scripts/build_native.sh smallstate_lm/rescoring/_native.c /src/native/
RUN bash /src/native/build_native.sh /src/native/_native.c /src/native/_native.so

# ---- runtime: the CUDA PyTorch base (its torch satisfies torch>=2.1), the package, lmplz
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends \
        libboost-program-options-dev libboost-system-dev libboost-thread-dev zlib1g libbz2-1.0 liblzma5 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/build/bin/lmplz /src/build/bin/build_binary /usr/local/bin/
COPY --from=build /wheels /wheels
WORKDIR /app
COPY pyproject.toml README.md ./
COPY smallstate_lm ./smallstate_lm
COPY --from=build /src/native/_native.so ./smallstate_lm/rescoring/
RUN pip install --no-cache-dir /wheels/*.whl . && rm -rf /wheels

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin smallstate
USER smallstate
ENV PYTHONUNBUFFERED=1 \
    SMALLSTATE_HOST=0.0.0.0 \
    SMALLSTATE_PORT=8000 \
    SMALLSTATE_LM=/models/lm
VOLUME ["/models"]
EXPOSE 8000
# /healthz says the process is up; orchestrators should route on /readyz (503 while loading or draining).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SMALLSTATE_PORT', '8000'), timeout=4)"
# SIGTERM (docker stop): /readyz turns 503, in-flight requests finish, then the process exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["smallstate-lm", "serve"]
