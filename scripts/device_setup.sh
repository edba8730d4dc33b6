#!/usr/bin/env bash
# Sourced first by the GPU-machine scripts: installs the carried wheels (.whl/, made by
# scripts/device_wheels.sh) and gpufeed itself into /tmp/site, and puts it on PYTHONPATH. A warm machine
# keeps /tmp, so a second call skips the install.
set -euo pipefail
WHEELS=${WHEELS:-.whl}   # .whl-decode for scripts/gpu_decode.sh (no Ray; nvImageCodec instead)
if [ ! -f "/tmp/site/.installed-$WHEELS" ] || [ "${REINSTALL:-0}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  touch "/tmp/site/.installed-$WHEELS"
fi
# gpufeed itself, every call: the checkout may have changed since the machine was warm.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
  --target /tmp/site . >/dev/null
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
