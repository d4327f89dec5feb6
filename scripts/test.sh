#!/usr/bin/env bash
# Run the whole test suite (creates the virtualenv on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
exec "$VENV/bin/python" -m pytest "$@"
