# Two commands on a fresh machine: `make run` and `make test`. Both build .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= config.example.yaml

.PHONY: run test venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,ray,engines,kubernetes,tracing]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/polymorph serve --config $(CONFIG)

# Two workers (pytest-xdist): Ray's and vLLM's tests each keep to one worker (xdist_group marks), one
# cluster or engine at a time; the few tests that compare wall-clock timings run after, alone.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not serial"
	$(PY) -m pytest -q -m serial

clean:
	rm -rf $(VENV) build *.egg-info
