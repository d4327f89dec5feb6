#!/usr/bin/env bash
# Create ./.venv with Python 3.11+ and install geoswarm with its dev tools (once per change of
# pyproject.toml). Sourced by scripts/run.sh and scripts/test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${GEOSWARM_VENV:-.venv}"
find_python() {
  for p in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
    [ -n "$p" ] || continue
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  echo "geoswarm needs Python 3.11 or newer (set PYTHON=/path/to/python3.11)" >&2
  return 1
}
if [ ! -x "$VENV/bin/python" ]; then
  "$(find_python)" -m venv "$VENV"
fi
stamp="$VENV/.geoswarm-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "installing geoswarm and its dependencies into $VENV (first run takes a few minutes)..." >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e '.[dev]'
  echo "$want" > "$stamp"
fi
# Our own modules compiled ahead (only what changed since): where PYTHONDONTWRITEBYTECODE is
# set, as in some CI sandboxes, every process (each worker, api, CLI run) would otherwise compile
# them again when it starts, half a second each.
"$VENV/bin/python" -m compileall -q -j 0 app workers spark bench migrations >/dev/null
if ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
  echo "note: no Java runtime found; Spark features need Java 17+ (everything else works)" >&2
fi
