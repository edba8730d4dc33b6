#!/usr/bin/env bash
# Installs everything the tests need into .venv and runs the whole suite (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
# Chromium renders the HTML report in one test. Installed with apt where this runs as root (a minute or two the
# first time); elsewhere that one test is skipped, and said so here.
if ! command -v chromium >/dev/null; then
  if [ "${GPUFEED_NO_APT:-0}" != 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
      || echo "scripts/test.sh: could not install chromium; the report's browser test will be skipped"
  else
    echo "scripts/test.sh: no chromium and no apt install here (not root, no apt-get, or GPUFEED_NO_APT=1): the" \
         "report's browser test will be skipped; install chromium to run it"
  fi
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Any torch >= 2.1 serves the tests (they need no GPU); 2.13.0 is the CPU build this machine kind keeps on disk.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
[ $rc -eq 5 ] && { echo "no tests collected"; exit 1; }
exit $rc
