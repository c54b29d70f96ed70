# The two commands of the README. Each creates .venv if missing and installs the project
# (editable) idempotently: a stamp file is refreshed only when pyproject.toml or constraints.txt change.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.needle-installed
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt
export HF_HUB_OFFLINE := 1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0

.PHONY: install browser demo lint format test test-fast clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	touch $(STAMP)

# The browser test drives Debian's Chromium (never a browser downloaded by a test tool); installed
# when missing and apt is usable, else that test is skipped with the reason.
browser:
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && { apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; }; } || echo "no Chromium: the browser test will be skipped"

demo: install
	$(BIN)/needle demo --workdir demo_run

# mypy: the low floors and the index protocols (query/index_protocol.py and query/live_index.py, the
# index that follows generations; shards/calls.py and the coordinator and shard actor that
# implement them); the other packages are read, not reported on.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy core index query shards/calls.py shards/coordinator.py shards/shard_actor.py

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: install browser lint
	$(BIN)/python -m pytest -m "not gpu" -q

# The quick tier for the edit-test loop: no slow, Ray, S3 or GPU tests (~1,100 tests; the longest
# took 95 s on a box shared with other test runs), and a hang fails after 5 minutes.
test-fast: install
	$(BIN)/python -m pytest -m "not gpu and not slow and not ray and not s3" -q --timeout 300

clean:
	rm -rf demo_run .pytest_cache
