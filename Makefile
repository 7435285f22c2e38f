.PHONY: setup demo test bench clean

VENV := .venv
BIN := $(VENV)/bin

setup:
	bash scripts/setup.sh

demo: setup
	$(BIN)/smallstate-lm demo

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/bench_forward.py

clean:
	rm -rf .build runs/demo
