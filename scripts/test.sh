#!/usr/bin/env bash
# Run the test suite (creates the virtualenv on first use); arguments go to pytest, e.g.
# `bash scripts/test.sh -m "not slow"` for the fast set.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh

# tests/e2e/test_dashboard_browser.py drives Debian's chromium through chromium-driver and skips
# without them. Install them where that needs no one's help (root with apt-get); a failure is
# only a note, and is not retried on every run while $stamp exists.
install_chromium() {
  [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] && return 0
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || return 0
  [ -z "${GEOSWARM_NO_APT:-}" ] || return 0
  local stamp="$VENV/.chromium-apt-failed" log="$VENV/chromium-apt.log"
  [ ! -f "$stamp" ] || return 0
  echo "installing chromium and chromium-driver with apt-get for the browser test (once)..." >&2
  if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
         chromium-driver; } >"$log" 2>&1; then
    rm -f "$log"
  else
    touch "$stamp"
    echo "note: apt-get could not install chromium (see $log; rm $stamp to retry);" \
         "the browser test will be skipped" >&2
  fi
}
install_chromium || true

# Without arguments: the whole suite in one process more than there are cores, at most 8
# (most tests spend much of their time waiting on servers they started; each process may run
# a SparkSession), each test file kept in one (its module's servers are shared by its tests;
# the files that use the in-process SparkSession share one process, and so one JVM);
# GEOSWARM_TEST_PROCESSES=N sets the number, 1 runs it in one. (Measured on 2 cores from a
# clean clone: two processes more took 1 034 s against 900, each test slower; the longest
# files first took 961 s, the Spark files then running together.)
cores="$(nproc 2>/dev/null || echo 2)"
processes="${GEOSWARM_TEST_PROCESSES:-$(( cores + 1 < 8 ? cores + 1 : 8 ))}"
if [ $# -eq 0 ] && [ "$processes" != 1 ]; then
  set -- -n "$processes" --dist loadfile
fi
exec "$VENV/bin/python" -m pytest "$@"
