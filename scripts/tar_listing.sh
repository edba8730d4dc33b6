#!/usr/bin/env bash
# ImageNet's train tar read in place (LAYOUT=tree: its train tree): its index (the tree: its listing) alone, in one
# process and in a pool (scripts/tar_index.py), then
# `convert imagenet` of it, page cache dropped first, this build and COMPARE (a `git archive` of another commit,
# carried as an ignored path) back to back, alternating; each conversion's timeline (listed, first shard) kept.
#
#   device run, carry .whl and compare-build:  PER=100 COMPARE=compare-build OUT=$OUT bash scripts/tar_listing.sh
#   CACHES="cold warm": the conversions also with the page cache as the runs before left it
#   VAL=50000: a flat val tar beside it (the conversions list both splits)
source "$(dirname "$0")/tar_data.sh" tar-index-KIND.jsonl
make_tars --processes "0,$WORKERS" --repeats "${REPEATS:-2}" --layout "${LAYOUT:-tar}" \
  --member-bytes "${MEMBER_BYTES:-110000}" --results "$RESULTS"
if [ -n "${COMPARE:-}" ]; then install_compare; fi
for cache in ${CACHES:-cold}; do
for round in 1 2; do
  for build in current ${COMPARE:+compare}; do
    path=/tmp/site; [ "$build" = compare ] && path=/tmp/site-compare:/tmp/site
    rm -rf "$DATA-out"
    [ "$cache" = cold ] && { sync; echo 3 > /proc/sys/vm/drop_caches; }
    (cd /tmp && PYTHONPATH=$path python3 -m gpufeed convert imagenet "$DATA" --to recordio --out "$DATA-out" \
      --workers "$WORKERS" --limit "${LIMIT:-4000}" --no-progress >/dev/null)
    python3 - "$DATA-out/manifest.json" "$build" "$round" "$RESULTS" "${LAYOUT:-tar}" "$cache" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
t = m["timings"]["timeline"]
row = {"bench": f"{sys.argv[5]}-convert", "build": sys.argv[2], "round": int(sys.argv[3]), "cache": sys.argv[6],
       "listed_s": t.get("listed"), "processes_ready_s": t.get("local_processes_started"),
       "first_shard_started_s": t.get("first_shard_started"),
       "seconds": m["timings"]["seconds"], "images": sum(s["written"] for s in m["splits"].values()),
       "workers": m["options"].get("workers")}
print(json.dumps(row))
with open(sys.argv[4], "a") as f:
    f.write(json.dumps(row) + "\n")
PY
  done
done
done
