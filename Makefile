# make test: create .venv/ at the repository root, install sftpack with its test
#            dependencies (through constraints.txt), lint and format-check with ruff,
#            type-check src/ with mypy (settings in pyproject.toml), run the whole suite
#            on two workers (pytest-xdist; a file's tests stay on one worker).
# make demo: same .venv/, then run the main job on the embedded default.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sftpack-installed

.PHONY: test demo bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n 2 --dist loadfile

demo: $(STAMP)
	$(VENV)/bin/sftpack demo

bench: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	@failed=""; for f in benchmarks/bench_*.py; do \
		echo "== $$f"; $(PY) $$f || failed="$$failed $$f"; \
	done; \
	if [ -n "$$failed" ]; then echo "benchmarks that failed:$$failed"; exit 1; fi; \
	echo "all benchmarks ran"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis src/*.egg-info
