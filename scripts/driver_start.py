"""Where a conversion's driver spends the time before convert()'s clock starts (scripts/driver_start.sh)."""

import json
import os
import subprocess
import sys
import time


def wall(*args: str) -> float:
    """Seconds of a python3 process running ``args``, start to exit."""
    t = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True)
    return time.perf_counter() - t


def main() -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--work", default="/tmp/gpufeed-start")
    args = p.parse_args()
    repeats, work = args.repeats, args.work
    for _ in range(repeats):
        bare = wall("-c", "pass")
        cli = wall("-c", "import gpufeed.cli, gpufeed.convert.command")
        engine = wall("-c", "import gpufeed.cli, gpufeed.convert.command, gpufeed.convert.engine, gpufeed.convert.progress")
        server = wall("-c", "from gpufeed.convert import forkserver; forkserver.start()")
        print(f"interpreter {bare:.3f} s; with the command line's imports {cli:.3f}; and the engine's {engine:.3f}; "
              f"starting the fork server {server:.3f}")
    imports = subprocess.run([sys.executable, "-X", "importtime", "-c", "import gpufeed.cli, gpufeed.convert.command, "
                              "gpufeed.convert.engine, gpufeed.convert.progress"], capture_output=True, text=True).stderr
    rows = [line.split("|") for line in imports.splitlines() if line.startswith("import time:") and "self" not in line]
    print("slowest imports (self us | cumulative us | module):")
    for row in sorted(rows, key=lambda r: -int(r[1]))[:12]:
        print(" ", row[0].split(":")[1].strip(), "|", row[1].strip(), "|", row[2].rstrip())
    # Trees made and removed as the node benchmark does (a marker beside each): anything else in the way is refused.
    from gpufeed.bench.experiments.convert_node import COMPLETE, build_corpus, make_tree_here, tree_made

    os.makedirs(work, exist_ok=True)
    src = os.path.join(work, "src")
    if not os.path.exists(src + COMPLETE):
        make_tree_here(src)
        build_corpus(src, 4000, 400, min(16, os.cpu_count()), layout="imagenet", mix="imagenet")
        tree_made(src)
    for _ in range(repeats):
        out = os.path.join(work, "out")
        make_tree_here(out)
        start = time.time()
        subprocess.run([sys.executable, "-m", "gpufeed", "convert", "imagenet", src, "--to", "recordio", "--out", out,
                        "--workers", str(min(16, os.cpu_count())), "--no-progress", "--no-resume"],
                       check=True, capture_output=True)
        end = time.time()
        tree_made(out)
        with open(os.path.join(out, "manifest.json")) as f:
            timings = json.load(f)["timings"]
        line = timings["timeline"]
        clock = timings["first_shard_started"] - line["first_shard_started"] - start
        print(f"convert: clock started {clock:.3f} s after the command; listed {line['listed']}; first shard "
              f"{line['first_shard_started']}; total {line['total']}; exit {end - start - clock - line['total']:.3f} s after")


if __name__ == "__main__":  # the corpus is built by a forkserver pool
    main()
