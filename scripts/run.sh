#!/usr/bin/env bash
# Start the whole system on embedded defaults: `geoswarm dev` (Redis, SQLite, api, workers).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
exec "$VENV/bin/geoswarm" dev "$@"
