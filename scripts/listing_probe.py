"""How long planning waits on a cold disk: listing a dataset tree and taking its inputs' identities (a stat
each), page cache dropped before each run. Needs root for drop_caches (the GPU machine). At 17a3493 it also
compared 4 and 8 listing/stat threads: slower on the GPU machine (results/convert-node-h200.txt), not kept.

    python3 scripts/listing_probe.py /tmp/gpufeed-node/src --repeats 2 --results OUT/listing.jsonl
    python3 scripts/listing_probe.py ~/imagenet --dataset imagenet
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def run_once(src: str, dataset: str) -> dict:
    from gpufeed.convert import identity
    from gpufeed.pipelines import open_source

    drop_caches()
    t0 = time.perf_counter()
    source = open_source(dataset, src)
    items = source.items(source.splits()[0])
    t1 = time.perf_counter()
    identity.identities(items, cache={})
    t2 = time.perf_counter()
    return {"bench": "listing-probe", "files": len(items), "list_s": round(t1 - t0, 3),
            "identities_s": round(t2 - t1, 3), "total_s": round(t2 - t0, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="a dataset tree, e.g. scripts/convert_node.sh's corpus (class folders)")
    ap.add_argument("--dataset", default="folder", help="its kind, as gpufeed convert takes it")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--results", default=None, help="append rows to this JSON-lines file")
    args = ap.parse_args()
    for _ in range(args.repeats):
        emit(run_once(args.src, args.dataset), args.results)


def emit(row: dict, results: str | None) -> None:
    """Print ``row`` and append it to the JSON-lines file ``results`` (where given)."""
    print(json.dumps(row), flush=True)
    if results:
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
