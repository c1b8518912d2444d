# ntx — two commands on a fresh Debian/Ubuntu machine: `make run` and `make test`.
PYTHON      ?= python3
VENV        := .venv
BIN         := $(VENV)/bin
CACHE       ?= $(HOME)/.cache/ntx
WHEELS      := $(CACHE)/wheels
PIP         := $(BIN)/python -m pip --disable-pip-version-check
PROMPT      ?= Explain in two sentences why the sky is blue.
LLAMA_CPP   := 0.3.36

.PHONY: run test venv venv-test llama-wheel fixtures vm-assets browser clean

run: $(BIN)/ntx-run .venv/.demo
	$(BIN)/ntx-run "$(PROMPT)" --max-tokens 64

test: .venv/.test fixtures vm-assets browser
	OPENBLAS_NUM_THREADS=1 $(BIN)/python -m pytest

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel setuptools cffi

NATIVE_SRC  := setup.py native/cffi_module.py $(wildcard native/nvme/*.c native/nvme/*.h native/nvme/*.py native/cpu/*.c native/cpu/*.h native/cpu/*.inc native/cpu/*.py)

$(BIN)/ntx-run: $(BIN)/python pyproject.toml $(NATIVE_SRC)
	$(PIP) install -q -e .
	touch $@

.venv/.demo: $(BIN)/ntx-run
	$(PIP) install -q -e '.[demo]'
	touch $@

# llama-cpp-python builds from source (10-20 min on 2 cores): build the wheel once, keep it in the cache.
llama-wheel:
	@mkdir -p $(WHEELS)
	@ls $(WHEELS)/llama_cpp_python-$(LLAMA_CPP)-*.whl >/dev/null 2>&1 || { \
	  echo "building llama-cpp-python $(LLAMA_CPP) from source (once; cached in $(WHEELS))"; \
	  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF" $(PIP) wheel --no-deps -w $(WHEELS) llama-cpp-python==$(LLAMA_CPP); }

.venv/.test: $(BIN)/ntx-run llama-wheel pyproject.toml $(NATIVE_SRC)
	$(PIP) install -q --find-links $(WHEELS) -e '.[test,demo]'
	touch $@

fixtures: .venv/.test
	$(BIN)/python scripts/build_fixtures.py --cache $(CACHE)/fixtures

# QEMU, guest kernel, initramfs and no-IOMMU vfio.ko for tests/vm (cached in NTX_VM_CACHE or ~/.cache/ntx/vm).
vm-assets:
	scripts/vm/install_host.sh
	scripts/vm/build_assets.sh

# Debian's chromium for the report page test (tests/engine/test_report.py drives it with playwright).
browser:
	@command -v chromium >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

clean:
	rm -rf $(VENV) build *.egg-info
