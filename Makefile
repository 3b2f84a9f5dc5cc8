# deform_surgeon — two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_MODEL := tests/fixtures/decoder_gathernd_1024.onnx
DEMO_OUT   := out/decoder_gathernd_1024.patched.onnx
MODEL ?=
OUT   ?= $(if $(MODEL),$(basename $(MODEL)).patched.onnx,)
ARGS  ?=
PYTEST_ARGS ?=

.PHONY: help install demo patch batch verify inspect test test-fast lint fixtures webgpu-setup placement budget serve split-1024 bench clean

help:
	@echo "make demo                      install, patch + verify the default 1024x1024 model, print the report"
	@echo "make test                      install (incl. WebGPU runtimes) and run the whole test suite"
	@echo "make patch MODEL=m.onnx [OUT=] patch a model (OUT defaults to <name>.patched.onnx beside it)"
	@echo "make batch MANIFEST=m.toml     patch every model of a TOML manifest in parallel (ARGS='--jobs 2 --verify')"
	@echo "make verify MODEL=a OUT=b      compare two models on ORT CPU, zero tolerance + exact bytes"
	@echo "make inspect MODEL=m.onnx      dry run: what would be rewritten or refused, and why"
	@echo "make placement MODEL=m.onnx    where ORT's WebGPU EP places the nodes (ARGS='--runtime browser')"
	@echo "make budget MODEL=m.onnx       tensors over the WebGPU buffer limits (ARGS='--max-buffer 256MiB')"
	@echo "make serve MODEL=m.onnx [OUT=] a page on 127.0.0.1: original and patched side by side on your GPU"
	@echo "make split-1024                BiRefNet's 64-channel blocks at 1024: split, verify, run on the 3 WebGPU runtimes (~1 h)"
	@echo "make bench                     patch time / RSS against load+save, 3 GB external model, batch --jobs 2"
	@echo "make fixtures | lint | webgpu-setup | clean"

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m compileall -q deform_surgeon   # an editable install is not byte-compiled; a wheel install is
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	mkdir -p out
	$(BIN)/deform-surgeon patch $(DEMO_MODEL) $(DEMO_OUT) --verify --report out/demo_report.json

patch: $(STAMP)
	@test -n "$(MODEL)" || { echo "usage: make patch MODEL=path/to/model.onnx [OUT=path]"; exit 2; }
	$(BIN)/deform-surgeon patch $(MODEL) $(OUT) $(ARGS)

verify: $(STAMP)
	@test -n "$(MODEL)" -a -n "$(OUT)" || { echo "usage: make verify MODEL=original.onnx OUT=patched.onnx"; exit 2; }
	$(BIN)/deform-surgeon verify $(MODEL) $(OUT) $(ARGS)

batch: $(STAMP)
	@test -n "$(MANIFEST)" || { echo "usage: make batch MANIFEST=models.toml [ARGS='--jobs 2 --verify']"; exit 2; }
	$(BIN)/deform-surgeon batch $(MANIFEST) $(ARGS)

inspect: $(STAMP)
	@test -n "$(MODEL)" || { echo "usage: make inspect MODEL=path/to/model.onnx"; exit 2; }
	$(BIN)/deform-surgeon inspect $(MODEL) $(ARGS)

webgpu-setup: $(STAMP)
	bash scripts/webgpu_setup.sh

serve: $(STAMP) webgpu-setup
	@test -n "$(MODEL)" || { echo "usage: make serve MODEL=path/to/model.onnx [OUT=patched.onnx] [ARGS='--device-profile spec-default']"; exit 2; }
	test -f $(OUT) || $(BIN)/deform-surgeon patch $(MODEL) $(OUT)
	$(BIN)/deform-surgeon serve $(MODEL) $(OUT) $(ARGS)

placement: $(STAMP) webgpu-setup
	@test -n "$(MODEL)" || { echo "usage: make placement MODEL=path/to/model.onnx [ARGS='--runtime browser --bundle jsep']"; exit 2; }
	$(BIN)/deform-surgeon placement $(MODEL) $(ARGS)

budget: $(STAMP)
	@test -n "$(MODEL)" || { echo "usage: make budget MODEL=path/to/model.onnx [ARGS='--max-buffer 256MiB']"; exit 2; }
	$(BIN)/deform-surgeon budget $(MODEL) $(ARGS)

split-1024: $(STAMP) webgpu-setup
	$(BIN)/python scripts/split_1024_webgpu.py --original $(ARGS)

bench: $(STAMP)
	$(BIN)/python scripts/bench_patch.py $(ARGS)

test: $(STAMP) webgpu-setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not webgpu" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check deform_surgeon scripts tests

# Re-export the exporter fixtures (needs torch; large download-free install from this machine's disk)
fixtures: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[fixtures]'
	$(BIN)/python scripts/make_fixtures.py --out tests/fixtures
	$(BIN)/python tests/helpers/graphs.py --out tests/fixtures

clean:
	rm -rf out .pytest_cache .ruff_cache .hypothesis
