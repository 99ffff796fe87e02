# Two commands do all setup on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# A socket of its own, so the demo never touches a daemon the user runs as a service.
DEMO_DIR ?= /tmp/moed-demo-$(shell id -u)
DEMO_SOCKET := $(DEMO_DIR)/moed.sock
PROMPT ?= def fibonacci(n):
# A quarter of the demo's experts in the cache, so the run shows real streaming (misses, reads).
BUDGET ?= 25%

.PHONY: run test bench clean

# setuptools adds a note to every editable install that it maps moed.* with an import hook (the
# package-dir layout): only that note is silenced; real build warnings still show.
$(STAMP): pyproject.toml
	@echo "==> installing moed and its dependencies into $(VENV) (a minute or two the first time)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install -e '.[test]'
	touch $(STAMP)
	@echo "==> installed; in a new shell, '. $(VENV)/bin/activate' puts moe and moed on PATH"

# Start a daemon on the embedded demo model, stream a completion with telemetry, stop the daemon.
run: $(STAMP)
	@MOED_CACHE_BUDGET='$(BUDGET)' MOED_STATE_DIR=$(DEMO_DIR)/state \
	  $(BIN)/moe --socket $(DEMO_SOCKET) run --raw --max-tokens 120 --start-timeout 300 '$(PROMPT)'; \
	  status=$$?; \
	  $(BIN)/moe --socket $(DEMO_SOCKET) stats || true; \
	  $(BIN)/moe --socket $(DEMO_SOCKET) stop >/dev/null 2>&1 || true; \
	  echo "==> moe and moed are in $(VENV)/bin: '. $(VENV)/bin/activate' puts them on PATH"; \
	  exit $$status

# The lint and format gate runs first, so .ci/run (which calls `make test`) enforces it.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

# Each prints ratios measured side by side in one run; BENCHMARKS.md holds their latest output.
bench: $(STAMP)
	$(BIN)/moed bench serve --max-tokens 200 --runs 9
	$(BIN)/moed bench stream
	$(BIN)/moed bench prewarm --runs 5
	$(BIN)/moed bench batch --rounds 5

clean:
	rm -rf $(VENV) build *.egg-info
