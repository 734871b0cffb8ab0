# make setup   create .venv with everything this machine needs (GPU or CPU), idempotently, and fetch the
#              vLLM 0.16.0 wheel the patch tests read
# make test    run the test suite (vLLM tests included)
# make demo    run every pipeline stage on configs/demo.yaml, in order

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/demo.yaml
PLATFORM := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
REQUIREMENTS := requirements.txt requirements-vllm-$(PLATFORM).txt requirements-assets.txt pyproject.toml
STAMP := $(VENV)/.setup-$(PLATFORM)

# The vLLM 0.16.0 wheel whose source tests/patches/ read, pinned by sha256: fetched here, so `make test` downloads nothing.
WHEELS := $(or $(EAGLE3_CACHE_DIR),$(HOME)/.cache/eagle3_pipeline)/wheels

.PHONY: setup vllm-source-wheel test demo clean-venv

setup: $(STAMP) vllm-source-wheel

vllm-source-wheel: $(STAMP)
	@ls $(WHEELS)/vllm-0.16.0-*.whl >/dev/null 2>&1 || $(PY) -m pip download -q --no-deps --only-binary=:all: \
		--require-hashes -r requirements-vllm-source.txt -d $(WHEELS)

# The stamp is newer than every requirements file once setup succeeded: rerunning is a no-op.
$(STAMP): $(REQUIREMENTS)
	@# The Mooncake client (capture.stream.transport mooncake) links libibverbs and librdmacm, TCP included.
	ldconfig -p | grep -q librdmacm.so.1 || { export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q --no-install-recommends libibverbs1 librdmacm1 || \
		{ apt-get update -q && apt-get install -y -q --no-install-recommends libibverbs1 librdmacm1; } || \
		{ echo "make setup: install libibverbs1 and librdmacm1 (apt, as root), then rerun" >&2; exit 1; }; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -r requirements-vllm-$(PLATFORM).txt -r requirements.txt
	$(PY) -m pip install --no-deps -r requirements-assets.txt
	$(PY) -m pip install --no-deps --no-build-isolation -e .
ifeq ($(PLATFORM),cpu)
	@# PyPI's torchvision, torchaudio and torchcodec are built against another torch: beside the CPU
	@# build they break imports in transformers and vLLM ("operator torchvision::nms does not exist").
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
endif
	touch $@

# Two processes, each on its own core and taking a whole file at a time (module fixtures are built once), in the
# order conftest.py gives (longest first; xdist would otherwise order files by their number of tests).
# TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

demo: setup
	$(PY) -m eagle3_pipeline config $(CONFIG)
	@for stage in 0[1-6]_*.py; do \
		[ -e "$$stage" ] || continue; \
		echo "== $$stage"; $(PY) $$stage --config $(CONFIG) || exit $$?; \
	done

clean-venv:
	rm -rf $(VENV)
