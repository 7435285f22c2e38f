.PHONY: setup demo test bench clean docker-smoke

VENV := .venv
BIN := $(VENV)/bin

setup:
	bash scripts/setup.sh

demo: setup
	$(BIN)/smallstate-lm demo

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/bench_forward.py
	$(BIN)/python benchmarks/bench_nbest.py
	test -f runs/demo/lm4.bin || $(BIN)/smallstate-lm demo
	$(BIN)/python benchmarks/bench_lattice.py
	$(BIN)/python benchmarks/bench_precision.py

# build the Docker image and check it running (scripts/docker_smoke.sh; BASE=IMAGE to build on your own base)
docker-smoke:
	bash scripts/docker_smoke.sh

clean:
	rm -rf .build runs/demo
