#!/usr/bin/env bash
# The tests that need a GPU, on the GPU machine: the loader's GPU paths, its pinned CPU path (batches made in the
# workers' pooled blocks, freed by the DataLoader's pinning), the pacing, the GPU crop (torchvision is there).
# Carries pytest (.whl-test: pytest and what it needs, py3-none-any wheels) beside .whl-decode; no Ray.
#
#   device run (any GPU kind), carry .whl-decode and .whl-test:  bash scripts/gpu_tests.sh [pytest args]
#   (.whl-test: python3 -m pip download --no-deps --only-binary=:all: -d .whl-test pytest pluggy iniconfig pygments packaging)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl-decode source scripts/device_setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-test/*.whl
python3 -c "import torch; print('cuda:', torch.cuda.is_available(), torch.cuda.device_count(), 'GPU(s)')"
rm -rf /tmp/gpufeed-tests && cp -r tests /tmp/gpufeed-tests && cd /tmp  # the checkout's gpufeed/ would shadow the installed package
python3 -m pytest -q -p no:cacheprovider /tmp/gpufeed-tests/${1:-test_loader.py} "${@:2}"
