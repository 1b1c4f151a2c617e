# Two commands on a fresh machine: `make demo` (the embedded end-to-end job) and `make test`.
# Both create .venv and install with torch pinned to the CPU wheel (constraints.txt) before anything else.
PYTHON ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/pip install -q -c constraints.txt
STAMP = $(VENV)/.installed
# pip installs torch (from the machine's own CPU wheel where there is one: uv would not look there), then uv, which
# installs the rest in seconds where pip takes minutes; where uv cannot be had or fails, pip installs it. uv
# compiles the bytecode as pip does: without it, every process compiled diffusers, transformers, ... on import
# wherever PYTHONDONTWRITEBYTECODE is set (as on this machine: 10 s instead of 6 s to import the trainer).
# $(call INSTALL,venv,arguments)
INSTALL = { [ -x $(1)/bin/uv ] || $(1)/bin/pip install -q uv; } && $(1)/bin/uv pip install -q --compile-bytecode --python $(1)/bin/python \
	-c constraints.txt $(2) \
	|| { echo "uv failed or is unavailable: installing with pip"; $(1)/bin/pip install -q -c constraints.txt $(2); }

# The suite runs the versions the reward images pin (deploy/requirements-*.txt, as constraints): a new release
# upstream (uvicorn 0.55 on 2026-12-02) reaches both only when those pins move.
$(STAMP): pyproject.toml constraints.txt deploy/requirements-cpu.txt deploy/requirements-models.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(call INSTALL,$(VENV),-c deploy/requirements-models.txt -e ".[dev]")
	@if $(VENV)/bin/pip list 2>/dev/null | grep -qi '^nvidia-'; then echo "CUDA packages were pulled in: check constraints.txt" >&2; exit 1; fi
	touch $(STAMP)

# PaddleOCR (the ocr_paddle scorer) pins its own numpy and OpenCV, which clash with .venv's, so its test
# runs the reward server under a venv of its own; the test models are PP-OCRv6 from the rapidocr wheel,
# converted by tests/paddle/build_models.py (rapidocr without its dependencies: only its model files).
PADDLE_VENV ?= .venv-paddle
PADDLE_STAMP = $(PADDLE_VENV)/.installed

$(PADDLE_STAMP): tests/paddle/requirements.txt pyproject.toml constraints.txt
	$(PYTHON) -m venv $(PADDLE_VENV)
	$(call INSTALL,$(PADDLE_VENV),-r tests/paddle/requirements.txt)
	$(call INSTALL,$(PADDLE_VENV),--no-deps rapidocr==3.10.0 -e .)
	@if $(PADDLE_VENV)/bin/pip list 2>/dev/null | grep -qi '^nvidia-\|^torch '; then echo "torch or CUDA packages in $(PADDLE_VENV)" >&2; exit 1; fi
	touch $(PADDLE_STAMP)

# The browser test drives Debian's chromium; OCR tests render text with DejaVu fonts. Installed when
# missing and apt-get is usable (root on Debian/Ubuntu); otherwise those tests say what to install.
SYSTEM_PACKAGES = chromium fonts-dejavu-core

.PHONY: install system-deps docker-deps slurm-deps paddle-env demo test test-slow test-all gpu-wheels lint
install: $(STAMP)

system-deps:
	@if [ -x /usr/bin/chromium ] && [ -d /usr/share/fonts/truetype/dejavu ]; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing $(SYSTEM_PACKAGES) with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
	else echo "note: install $(SYSTEM_PACKAGES) for the browser and OCR tests"; fi

# The compose test (tests/integration/test_docker_compose.py) builds the reward images with Debian's Docker
# engine, compose and debootstrap (no Docker Hub here: deploy/offline_base.sh makes the base image).
DOCKER_PACKAGES = docker.io docker-compose debootstrap
docker-deps:  ## Docker's engine, compose and debootstrap, from apt-get when missing (root)
	@if command -v dockerd >/dev/null && command -v debootstrap >/dev/null && \
		{ docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; }; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing $(DOCKER_PACKAGES) with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DOCKER_PACKAGES) >/dev/null; \
	else echo "note: install $(DOCKER_PACKAGES) for the compose test"; fi

# The SLURM test (tests/integration/test_slurm.py, slow tier) runs deploy/slurm.sbatch on a private one-node cluster
# (tests/slurm_cluster.py): Debian's munge, slurmctld, slurmd and SLURM's commands.
SLURM_PACKAGES = munge slurmctld slurmd slurm-client
slurm-deps:  ## SLURM's daemons and commands for its test, from apt-get when missing (root)
	@if command -v sbatch >/dev/null && [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ]; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing $(SLURM_PACKAGES) with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SLURM_PACKAGES) >/dev/null; \
	else echo "note: install $(SLURM_PACKAGES) for the SLURM test"; fi

paddle-env: $(PADDLE_STAMP)  ## .venv-paddle and the PaddleOCR test models (tests/integration/test_ocr_paddle.py)
	$(PADDLE_VENV)/bin/python tests/paddle/build_models.py

demo: $(STAMP)  ## the embedded default: SFT warm-up on digits, then GRPO against local reward servers
	$(VENV)/bin/python trainer/main.py $(ARGS)

# The suite in two tiers: `make test` is the default one (pyproject's addopts leave out tests marked slow or
# gpu); `make test-slow` runs the slow tier (long training runs, job matrices), CI both. pytest exits 5 when
# a tier selects nothing (e.g. ARGS naming files without slow tests): that is no failure. pytest-xdist runs
# one worker more than the cores (TEST_WORKERS=0: one process): most tests are single-threaded Python at these
# sizes, and many wait on processes they start (reward servers, torchrun, stops and resumes), which the extra
# worker fills (a 6-file sample of the default tier on 2 cores: 135 s with 3 workers, 159 s with 2).
TEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) + 1 )))
PYTEST_TIER = status=0; $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(1) $(ARGS) || status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest: no test of this tier selected"; else exit $$status; fi

test: $(STAMP) system-deps  ## the default tier (~8 min on 2 AVX-512 cores; tests marked slow or gpu excluded)
	@$(call PYTEST_TIER,)

test-slow: $(STAMP) system-deps  ## the slow tier alone (~18 min on 2 AVX-512 cores)
	@$(call PYTEST_TIER,-m "slow and not gpu")

test-all: $(STAMP) system-deps  ## both tiers in one run (~25 min on 2 AVX-512 cores; what CI runs)
	@$(call PYTEST_TIER,-m "not gpu")

GPU_PYTHON ?= 3.12
# What a CUDA image with torch lacks to run the trainer, its reward replicas and the GPU suite: our pinned versions.
GPU_WHEELS = diffusers transformers peft importlib_metadata zipp typing_extensions pydantic pydantic_core \
	annotated_types typing_inspection fastapi starlette uvicorn python-multipart opentelemetry-api
gpu-wheels: $(STAMP)  ## .gpu-wheels/: those wheels for a CUDA image's Python (GPU_PYTHON); pip install --no-deps there
	rm -rf .gpu-wheels && $(VENV)/bin/pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) -d .gpu-wheels \
		$$(for p in $(GPU_WHEELS); do echo "$$p==$$($(VENV)/bin/python -c "from importlib.metadata import version; print(version('$$p'))")"; done)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
