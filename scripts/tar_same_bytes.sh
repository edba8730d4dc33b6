#!/usr/bin/env bash
# The whole of an ImageNet-shaped train tar converted by this build and by COMPARE (a `git archive` of another
# commit, carried as an ignored path), then verified and compared byte for byte: a change to how the tar is listed
# must not change a byte of the output.
#
#   device run, carry .whl and compare-build:  PER=100 COMPARE=compare-build OUT=$OUT bash scripts/tar_same_bytes.sh
#   VAL=50000: with a flat val tar beside it (both splits converted)
source "$(dirname "$0")/tar_data.sh" tar-same-bytes-KIND.jsonl
make_tars --repeats 0
install_compare
for build in current compare; do
  path=/tmp/site; [ "$build" = compare ] && path=/tmp/site-compare:/tmp/site
  rm -rf "$DATA-$build"
  start=$(date +%s%N)
  (cd /tmp && PYTHONPATH=$path python3 -m gpufeed convert imagenet "$DATA" --to "${FORMATS:-recordio}" \
    --out "$DATA-$build" --workers "$WORKERS" --no-progress | tail -2)
  echo "$build: $(( ($(date +%s%N) - start) / 1000000 )) ms from the command's start to its exit"
done
(cd /tmp && python3 -m gpufeed verify "$DATA-current" | tail -1)
for f in $(cd "$DATA-current" && find . -type f ! -name manifest.json ! -path "./.gpufeed/*" | sort); do
  cmp "$DATA-current/$f" "$DATA-compare/$f" && echo "same: $f"
done
