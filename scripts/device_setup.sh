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
# The machine's environment sets PYTHONDONTWRITEBYTECODE=1 and its site-packages hold no bytecode, so every process
# compiled NumPy's, OpenCV's and gpufeed's sources as it imported them: a conversion's driver started its clock
# 0.44-0.66 s after the command instead of 0.18-0.24 s (results/driver-start-h100x2.txt), and every fork server,
# Ray worker and DataLoader worker paid the same, where a user's pip-installed packages come with their bytecode.
# Bytecode is kept under /tmp/pycache instead (the machine's own folders are left as they are), and written once
# here for what a conversion imports.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
# warm_bytecode: writes it for the build on PYTHONPATH (scripts/convert_node.sh calls it again for a COMPARE build).
warm_bytecode() {
  (cd /tmp && python3 -c "import gpufeed.cli, gpufeed.convert.command, gpufeed.convert.engine, gpufeed.convert.progress, \
gpufeed.convert.worker, gpufeed.pipelines.transforms, cv2" >/dev/null 2>&1) || true
}
warm_bytecode
