# Set-up and entry points. `make run` and `make test` create (or reuse) a Python 3.12 venv in .venv.
# Python 3.12 is found as: $(PYTHON) if given, else `python3.12` on PATH, else pyenv's 3.12.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

define find_python312
$(or $(PYTHON),$(shell for c in python3.12 "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do \
  "$$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo "$$c"; break; }; done))
endef

.PHONY: setup run test test-gpu test-skyrl-install clean

$(VENV)/.installed: pyproject.toml Makefile
	@py="$(call find_python312)"; \
	if [ -z "$$py" ]; then echo "error: Python 3.12 not found (install it, or pass PYTHON=/path/to/python3.12)" >&2; exit 1; fi; \
	echo "using $$py"; [ -x $(PY) ] || "$$py" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev,skyrl]' && $(PY) -m pip install -q --no-deps skyrl==0.4.0
	touch $@

setup: $(VENV)/.installed

# The main job on its embedded default: train the tiny GLM-5.3-Flash recipe on 4 Ray CPU ranks.
run: setup
	$(VENV)/bin/skyrl-kda run glm53_flash_tiny --overwrite  # a rerun moves the last run aside

test: setup
	TORCHDYNAMO_DISABLE=1 $(PY) -m pytest -q --durations=15 tests

# On a CUDA machine: the GPU parity tests with fla kernels.
test-gpu: setup
	$(PY) -m pip install -q -e '.[gpu]'
	$(PY) -m pytest -q -m gpu tests

# Before each release, not in CI (it downloads several GB from PyPI each run; docs/skyrl.md says why):
# a fresh venv with skyrl 0.4.0 installed with its own pins, this package installed into it, the
# KDA entrypoint's dry run and one CPU RL step (docs/skyrl.md, "Install"). Its venv and logs go
# under SKYRL_ENV_DIR (default: a new folder in TMPDIR or /tmp), never in the checkout.
test-skyrl-install:
	PYTHON="$(PYTHON)" bash tests/install/skyrl_env.sh $(SKYRL_ENV_DIR)

clean:
	rm -rf $(VENV)
