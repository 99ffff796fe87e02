# Two commands do all setup on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# One stamp per install and pyproject.toml: the demo's (moed and what it needs) and the test
# extras' (pytest, ruff, mypy, the SDKs the gateway tests drive) on top of it.
PYPROJECT_SUM := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.installed-$(PYPROJECT_SUM)
TEST_STAMP := $(VENV)/.installed-test-$(PYPROJECT_SUM)
# pip's own lines (a hundred and more on a first install) only with VERBOSE=1.
PIP_QUIET := $(if $(VERBOSE),,--quiet)
# A socket of its own, so the demo never touches a daemon the user runs as a service.
DEMO_DIR ?= /tmp/moed-demo-$(shell id -u)
DEMO_SOCKET := $(DEMO_DIR)/moed.sock
PROMPT ?= def fibonacci(n):
# A quarter of the demo's experts in the cache, so the run shows real streaming (misses, reads).
BUDGET ?= 25%

.PHONY: run test test-fast typecheck test-clients bench clean

# setuptools adds a note to every editable install that it maps moed.* with an import hook (the
# package-dir layout): only that note is silenced; real build warnings still show.
$(STAMP): pyproject.toml
	@echo "==> installing moed and its dependencies into $(VENV) (a minute or two the first time; VERBOSE=1 shows pip's lines)"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install $(PIP_QUIET) --disable-pip-version-check --upgrade pip
	@PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install $(PIP_QUIET) --disable-pip-version-check -e .
	@touch $(STAMP)
	@echo "==> installed; in a new shell, '. $(VENV)/bin/activate' puts moe and moed on PATH"

# The test extras, for make test, test-fast, typecheck and bench (make run never needs them).
$(TEST_STAMP): $(STAMP)
	@echo "==> installing the test tools (pytest, ruff, mypy, the API SDKs) into $(VENV)"
	@PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install $(PIP_QUIET) --disable-pip-version-check -e '.[test]'
	@touch $(TEST_STAMP)

# Start a daemon on the embedded demo model, stream a completion with telemetry, stop the daemon.
run: $(STAMP)
	@MOED_CACHE_BUDGET='$(BUDGET)' MOED_STATE_DIR=$(DEMO_DIR)/state \
	  $(BIN)/moe --socket $(DEMO_SOCKET) run --raw --max-tokens 120 --start-timeout 300 '$(PROMPT)'; \
	  status=$$?; \
	  $(BIN)/moe --socket $(DEMO_SOCKET) stats || true; \
	  $(BIN)/moe --socket $(DEMO_SOCKET) stop >/dev/null 2>&1 || true; \
	  echo "==> moe and moed are in $(VENV)/bin: '. $(VENV)/bin/activate' puts them on PATH"; \
	  exit $$status

# The agents and CLIs tests/gateway/test_gateway_agents.py drives, as their registries ship them, cached
# outside the checkout; one that fails to install is skipped by its test, which says why.
TEST_CLIENTS ?= $(HOME)/.cache/moed/test-clients
NPM_CLIENTS := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 opencode-ai@1.18.33
PY_CLIENTS := llm==0.36 litellm==1.110.2 aider-chat==0.86.2
CLIENTS_STAMP := $(TEST_CLIENTS)/.installed-$(shell echo '$(NPM_CLIENTS) $(PY_CLIENTS)' | cksum | cut -d' ' -f1)

test-clients: $(CLIENTS_STAMP)

# npm and the three venvs install side by side (separate folders, logs under logs/): on a fresh
# machine the downloads overlap instead of queueing.
$(CLIENTS_STAMP):
	@echo "==> installing the agent clients the gateway tests drive into $(TEST_CLIENTS)"
	@mkdir -p $(TEST_CLIENTS)/logs
	@pending=; \
	  npm install --prefix $(TEST_CLIENTS)/npm --no-audit --no-fund --loglevel=error $(NPM_CLIENTS) \
	    >$(TEST_CLIENTS)/logs/npm.log 2>&1 & pending="$$pending $$!:npm"; \
	  for spec in $(PY_CLIENTS); do name=$${spec%%==*}; \
	    { $(PYTHON) -m venv $(TEST_CLIENTS)/py-$$name && \
	      $(TEST_CLIENTS)/py-$$name/bin/pip install --quiet --disable-pip-version-check "$$spec"; } \
	      >$(TEST_CLIENTS)/logs/py-$$name.log 2>&1 & pending="$$pending $$!:py-$$name"; \
	  done; \
	  ok=1; for job in $$pending; do \
	    wait $${job%%:*} || { ok=0; echo "==> $${job#*:} failed:"; tail -n 20 $(TEST_CLIENTS)/logs/$${job#*:}.log; }; \
	  done; \
	  if [ $$ok = 1 ]; then touch $@; else echo "==> some clients did not install: their tests skip"; fi

PYTEST := $(BIN)/python -m pytest -q
# make test's parallel phase: each test file on one of TEST_WORKERS workers (a module's fixtures,
# a shared daemon or gateway, stay in one process).
TEST_WORKERS ?= 2

# mypy (settings in pyproject's [tool.mypy]) reads moed.* through links named as the package-dir
# mapping names them: mypy cannot run the editable install's import hook.
MYPY_TREE := build/mypy/moed
MOED_ROOMS := protocol daemon client gateway launchd

# The type gate alone, for the edit loop ([tool.mypy] in pyproject.toml names the strict rooms).
typecheck: $(TEST_STAMP)
	@mkdir -p $(MYPY_TREE) && for room in $(MOED_ROOMS); do ln -sfn ../../../$$room $(MYPY_TREE)/$$room; done
	$(BIN)/mypy

# The lint, format and type gates run first, so .ci/run (which calls `make test`) enforces them.
# The venv and the agent clients install side by side; then every test not marked `serial` on the
# workers, then the `serial` ones alone (swap, cgroup limits, system-wide memory readers:
# pyproject.toml). The serial phase runs even after a failed parallel one, and either failing
# fails the target.
test:
	@$(MAKE) --no-print-directory -j2 $(TEST_STAMP) test-clients
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) --no-print-directory typecheck
	@status=0; \
	  echo "==> parallel phase: $(TEST_WORKERS) workers, every test not marked serial"; \
	  MOED_TEST_CLIENTS=$(TEST_CLIENTS) $(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not serial" \
	    --durations=25 || status=$$?; \
	  echo "==> serial phase: the tests marked serial, one at a time"; \
	  MOED_TEST_CLIENTS=$(TEST_CLIENTS) $(PYTEST) -m serial --durations=10 || status=$$?; \
	  exit $$status

# The edit loop: lint and types, then the tests that start no process and are not slow.
test-fast: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) --no-print-directory typecheck
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not process and not serial and not slow" \
	  --durations=10

# Each prints ratios measured side by side in one run; BENCHMARKS.md holds their latest output.
bench: $(TEST_STAMP)
	$(BIN)/moed bench serve --max-tokens 200 --runs 9
	$(BIN)/moed bench stream
	$(BIN)/moed bench prewarm --runs 5
	$(BIN)/moed bench batch --rounds 5

clean:
	rm -rf $(VENV) build *.egg-info
