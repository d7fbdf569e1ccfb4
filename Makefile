# Two commands set everything up on a fresh machine:
#   make demo   create .venv if missing, install, compare the classic and zero-bubble schedules
#   make test   same set-up, then the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_DIR ?= demo-output

.PHONY: demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,plot,exact,runtime]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pipeloom compare gpipe 1f1b interleaved chimera zb-h1 zb-h2 zb-2p zb-v -p 8 -m 16 -v 2 \
		--costs F=1,B=1,W=1,M_W=0.25 --plot-dir $(DEMO_DIR)

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) bench/sim_speed.py
	$(PY) bench/zb_table5.py
	$(PY) bench/mario.py
	$(PY) bench/tpipe.py
	$(PY) bench/svpp.py
	$(PY) bench/runtime_vs_torch.py

clean:
	rm -rf $(VENV) $(DEMO_DIR) build src/*.egg-info .pytest_cache
