# gograph developer entry points. The README's two commands are `make demo` and `make test`.
#
# Everything runs in .venv (created on first use from CPython 3.12 when available, since the
# GPU machine runs 3.12; any 3.10-3.12 works). Go >= 1.26 and a C compiler must be on PATH.

SHELL := /bin/bash
PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12 2>/dev/null) python3)
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.11.*
GO ?= go
# The CUDA header and link stub that `setup.py` found/made, reused for `go vet -tags cuda`.
CUDA_INCLUDE = $(shell $(PY) -c 'from build_support.cudastub import find_cuda_header as f; h=f()[0]; print(h.include_dir if h else "")')

.PHONY: venv build test test-go test-py vet fuzz fuzz-short demo bench gpu-bundle gpu-run clean

venv: $(VENV)/.ready
$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" "pytest>=7" numpy "pybindgen>=0.22" "setuptools>=68" wheel "nvidia-cuda-runtime-cu12>=12.4,<13"
	touch $@

# Builds both flavors in place (python/gograph/_core_cpu, _core_cuda) for the venv's CPython.
build: venv
	$(PY) setup.py -q build_ext --inplace

vet:
	@test -z "$$(gofmt -l gograph internal tools)" || { echo "gofmt needed:"; gofmt -l gograph internal tools; exit 1; }
	$(GO) vet ./...

test-go: vet build
	$(GO) test -race -count=1 ./...
	CGO_CPPFLAGS="-I$(CUDA_INCLUDE)" LIBRARY_PATH="$(CURDIR)/_gopy_build/cudastub" $(GO) vet -tags cuda ./...

test-py: build
	PYTHONPATH=python $(PY) -m pytest -q tests

# The README's test command: Go vet + race tests, both flavors compiled, pytest (CPU here;
# `cuda`-marked tests skip with a reason when there is no GPU), and a short run of every fuzz target.
test: test-go test-py fuzz-short

# Every Go fuzz target (discovered with `go test -list`), one after the other: ~5s each in
# `make test`, longer with `make fuzz` (FUZZTIME=10m make fuzz for a soak; see docs/RELIABILITY.md).
fuzz-short:
	GO=$(GO) FUZZTIME=$${FUZZTIME:-5s} bash scripts/fuzz.sh

fuzz:
	GO=$(GO) FUZZTIME=$${FUZZTIME:-60s} bash scripts/fuzz.sh

# The README's main job: graph a small model and print what it gained.
demo: build
	PYTHONPATH=python $(PY) examples/demo.py

bench: build
	PYTHONPATH=python $(PY) bench/run.py

# Builds what the GPU machine needs (cp312 extensions, in place); scripts/gpu-run.sh runs there.
# See CONTRIBUTING.md: run it with the device tool, carrying the two _core_* folders.
gpu-bundle: build
	@$(PY) -c 'import sys; assert sys.version_info[:2]==(3,12), "the GPU machine runs CPython 3.12: set PYTHON to a 3.12 interpreter and remove .venv"'
	@ls python/gograph/_core_cuda/_gographcore*.so python/gograph/_core_cpu/_gographcore*.so

clean:
	rm -rf _gopy_build build dist python/*.egg-info
	rm -f python/gograph/_core_*/_gographcore*.so python/gograph/_core_*/gographcore.py python/gograph/_core_*/go.py
