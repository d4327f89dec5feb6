# Chores. The README's Quickstart uses scripts/run.sh and scripts/test.sh directly, so that
# nothing but Python 3.11+ (and Java 17+ for Spark) is needed on a fresh machine.
.PHONY: run test test-fast lint bench

run:
	bash scripts/run.sh

test:
	bash scripts/test.sh

test-fast:
	bash scripts/test.sh -m "not slow"

lint:
	bash -c 'source scripts/bootstrap.sh && $$VENV/bin/ruff check . && $$VENV/bin/mypy app workers spark bench'

bench:
	bash -c 'source scripts/bootstrap.sh && $$VENV/bin/geoswarm bench pipeline'
