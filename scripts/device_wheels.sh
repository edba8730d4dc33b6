#!/usr/bin/env bash
# Builds .whl/: the cp312 wheels the GPU machine lacks (it reaches no registry), small enough for one
# device call (64 MiB with the working tree).
#
#   bash scripts/device_wheels.sh            # then carry .whl and run scripts/device_setup.sh there first
#
# Ray's wheel is ~79 MB, over one call's limit, and 32 MB of it are the Java workers' jars (ray/jars),
# which a Python-only runtime never loads; the RL, serving, tuning, training and LLM libraries are not used
# by gpufeed either. The wheel is rewritten without them (RECORD rewritten to match, so pip installs it as
# usual), which brings it to ~43 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=.whl
mkdir -p "$WHL"
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
         "${PLAT[@]}" -d "$1" "${@:2}"; }
# Ray's dependencies that the machine's python3 lacks (it has click, filelock, msgpack, packaging,
# protobuf, pyyaml, requests); lmdb and crc32c for the formats.
dl "$WHL" lmdb==3.0.0 crc32c==2.9.post0 jsonschema referencing rpds-py jsonschema-specifications attrs
# .whl-decode: what scripts/gpu_decode.sh needs (the loader's GPU paths, no Ray), ~30 MB.
mkdir -p .whl-decode
cp "$WHL"/lmdb-*.whl "$WHL"/crc32c-*.whl .whl-decode/
dl .whl-decode nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dl "$tmp" "ray==${RAY_VERSION:-2.60.0}"
python3 - "$tmp"/ray-*.whl "$WHL" <<'EOF'
import os, sys, zipfile
src, dst_dir = sys.argv[1], sys.argv[2]
drop = ("ray/jars/", "ray/rllib/", "ray/serve/", "ray/tune/", "ray/train/", "ray/llm/")
dst = os.path.join(dst_dir, os.path.basename(src))
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if info.filename.startswith(drop):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line + b"\n" for line in data.splitlines() if not line.decode().startswith(drop))
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
print(f"{dst}: {os.path.getsize(dst) / 1e6:.1f} MB (from {os.path.getsize(src) / 1e6:.1f} MB)")
EOF
du -sh "$WHL"
