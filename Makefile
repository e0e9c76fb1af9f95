# Two commands for a new machine: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
TORCH ?= torch==2.13.0
# Where torch comes from when not the default index (e.g. https://download.pytorch.org/whl/cpu).
TORCH_INDEX ?=
# fbgemm-gpu-cpu's .so files are built against one torch minor (FBGEMM's compatibility table:
# 1.8 for torch 2.13, 1.9 for torch 2.14); a mismatched pair fails at `import torchrec`.
FBGEMM ?= fbgemm-gpu-cpu==$(if $(findstring 2.14,$(TORCH)),1.9.0,1.8.0)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# One stamp per torch and fbgemm requirement: `make TORCH=... test` reinstalls when the pin changes.
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH)-$(FBGEMM)' | tr -c 'A-Za-z0-9.\n' '_')

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# No stamp while installing: an install that fails part way is redone by the next make.
	rm -f $(VENV)/.installed-*
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	# torchrec on CPU: the CPU fbgemm first, then torchrec without its CUDA fbgemm dependency.
	$(PIP) install -q "$(FBGEMM)" tensordict "torchmetrics==1.0.3" tqdm pyre-extensions
	$(PIP) install -q --no-deps "torchrec==1.9.2"
	$(PIP) install -q -e ".[test,bench]"
	# Fail here, naming the cause, rather than at test collection.
	$(PY) -c "import torchrec" || { echo "torchrec does not load with $(TORCH) and $(FBGEMM): set FBGEMM=fbgemm-gpu-cpu==<the release for this torch>" >&2; exit 1; }
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m torchpipe.demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m torchpipe.bench all

clean:
	rm -rf $(VENV) build *.egg-info
