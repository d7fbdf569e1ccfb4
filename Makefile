# Two commands set everything up on a fresh machine:
#   make demo   create .venv if missing, install; tune a small model for this machine (profile it, search,
#               run the best plan, show predicted vs measured); tune GPT3-13B on 32 A100-40G from presets;
#               compare the classic and zero-bubble schedules in one figure
#   make test   same set-up, then lint (ruff), types (mypy: the planning core, then everything) and
#               the whole test suite on every core
#   make lint   just ruff and mypy
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_DIR ?= demo-output

.PHONY: demo test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torchvision (the `vision` extra) goes beside the venv, not into it: PyPI's build breaks
# `import transformers` next to the CPU torch (see pyproject.toml), and the venv must stay what a
# user of `pipeloom[models]` has. tests/conftest.py puts it on the path for the ResNet tests.
# torchtitan and megatron-core go beside it too, without their dependencies (datasets, wandb, ...:
# what reading torchtitan's config and placing its stages need is listed), for the tests of
# `export-plan --for torchtitan|megatron` against their own code.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,plot,exact,runtime,models,logs]'
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt --no-deps --upgrade \
		--target $(VENV)/vision-for-tests torchvision
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt --no-deps --upgrade \
		--target $(VENV)/torchtitan-for-tests torchtitan spmd_types tyro docstring_parser typeguard
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt --no-deps --upgrade \
		--target $(VENV)/megatron-for-tests megatron-core
	touch $(STAMP)

demo: $(STAMP)
	mkdir -p $(DEMO_DIR)
	$(VENV)/bin/pipeloom profile --model examples/tiny-llama.json --mbs 1,2,4 --layers 1,2,4 \
		--output $(DEMO_DIR)/profile.json --force
	$(VENV)/bin/pipeloom tune --costs $(DEMO_DIR)/profile.json --devices 2 --memory 1GiB --global-batch 8 \
		--runnable --max-mbs 4 --explain --output $(DEMO_DIR)/cpu-plan.json --force
	$(VENV)/bin/pipeloom train --plan $(DEMO_DIR)/cpu-plan.json
	$(VENV)/bin/pipeloom tune --model gpt3-13b --hardware a100-40g --devices 32 --memory 40GiB \
		--global-batch 128 --explain --output $(DEMO_DIR)/gpt3-13b-plan.json --force
	$(VENV)/bin/pipeloom compare gpipe 1f1b interleaved chimera zb-h1 zb-h2 zb-2p zb-v -p 8 -m 16 -v 2 \
		--costs F=1,B=1,W=1,M_W=0.25 --plot $(DEMO_DIR)/compare.png

CORE := src/pipeloom/__init__.py src/pipeloom/errors.py src/pipeloom/units.py src/pipeloom/files.py \
	src/pipeloom/costs.py src/pipeloom/budget.py src/pipeloom/static_memory.py src/pipeloom/provenance.py \
	src/pipeloom/ir src/pipeloom/sim \
	src/pipeloom/schedules src/pipeloom/passes src/pipeloom/tune src/pipeloom/profile_format.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy $(CORE)
	$(VENV)/bin/mypy src/pipeloom

# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set: every worker, and every rank a test
# spawns, would otherwise compile pipeloom (and pytest rewrite the tests) anew.
test: lint
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n auto --dist worksteal

bench: $(STAMP)
	$(PY) bench/sim_speed.py
	$(PY) bench/run_overhead.py
	$(PY) bench/zb_table5.py
	$(PY) bench/mario.py
	$(PY) bench/tpipe.py
	$(PY) bench/svpp.py
	$(PY) bench/svpp_table3.py
	$(PY) bench/dualpipe.py
	$(PY) bench/tune_speed.py
	$(PY) bench/capacity.py
	$(PY) bench/fidelity.py
	$(PY) bench/user_path.py
	$(PY) bench/fused_backward.py
	$(PY) bench/slices.py
	$(PY) bench/runtime_vs_torch.py
	$(PY) bench/split_backward.py
	$(PY) bench/compiled_stages.py
	$(PY) bench/real_model.py
	$(PY) bench/real_model.py --model resnet152 --microbatch-size 2

clean:
	rm -rf $(VENV) $(DEMO_DIR) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
