"""``gpufeed bench tiers``: list the profiles, self-test the emulator, measure the host disk."""

from __future__ import annotations

import json
import tempfile

from gpufeed.bench.tiers import DEFAULT_GIB, PROFILES, get_profile


def add_arguments(parser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", action="store_true", help="print every profile's limits and source")
    what.add_argument("--self-test", action="store_true",
                      help="time the emulator against each profile (4 KiB random QD1/QD32, 1 MiB sequential)")
    what.add_argument("--host", metavar="DIR", help="measure the disk under DIR (cold reads) and say which "
                                                    "profiles it can emulate")
    parser.add_argument("--profile", action="append", choices=sorted(PROFILES),
                        help="profiles to list or test (default: all)")
    parser.add_argument("--size-gib", type=float, default=DEFAULT_GIB, help="disk size C the formulas use")
    parser.add_argument("--seconds", type=float, default=0.5, help="seconds per self-test / host pattern")
    parser.add_argument("--dir", default=None, help="directory for the self-test's small file (default: a "
                                                    "temporary one)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    names = args.profile or list(PROFILES)
    if args.list:
        rows = [get_profile(n).describe(args.size_gib) for n in names]
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        print(f"{'profile':<12}{'IOPS':>9}{'MB/s':>8}{'latency':>10}{'I/O unit':>10}  source")
        for r in rows:
            print(f"{r['profile']:<12}{r['iops']:>9.0f}{r['mb_per_s']:>8.0f}{r['latency_ms']:>8.2f}ms"
                  f"{r['io_unit_kib']:>7.0f}KiB  {r['product']}; {r['source']}")
        return 0
    if args.self_test:
        return _self_test(args, names)
    return _host(args, names)


def _self_test(args, names) -> int:
    from gpufeed.bench.emulate import self_test

    report = {}
    with tempfile.TemporaryDirectory(prefix="gpufeed-selftest-", dir=args.dir) as d:
        for n in names:
            report[n] = self_test(get_profile(n).limits(args.size_gib), d, seconds=args.seconds)
            if not args.json:
                for r in report[n]:
                    note = "saturated" if r["saturated"] else "latency-bound"
                    if r["host_limited"]:
                        note += f", host-limited (loop alone {r['unthrottled']:.0f}/s)"
                    print(f"{n:<12}{r['pattern']:<14}expected {r['expected']:>9.0f}/s  emulated "
                          f"{r['emulated']:>9.0f}/s  error {r['error']:+7.1%}  ({note})")
    if args.json:
        print(json.dumps(report, indent=2))
    bad = [(n, r["pattern"], r["error"]) for n, rs in report.items() for r in rs
           if r["saturated"] and not r["host_limited"] and abs(r["error"]) > 0.10]
    for n, p, e in bad:
        print(f"gpufeed: self-test: {n} {p} is off by {e:+.1%} (target within 10% for saturated patterns)")
    return 1 if bad else 0


def _host(args, names) -> int:
    from gpufeed.bench.hostdisk import check_emulation, measure_host

    host = measure_host(args.host, seconds=args.seconds)
    verdicts = {n: check_emulation(host, get_profile(n).limits(args.size_gib)) for n in names}
    if args.json:
        print(json.dumps({"host": host, "invalid": verdicts}, indent=2))
        return 0
    for name, r in host["patterns"].items():
        print(f"host {name:<14}{r['iops']:>9.0f} req/s {r['mb_per_s']:>8.1f} MB/s  from device "
              f"{r['device_fraction']:.0%}")
    for n, reasons in verdicts.items():
        print(f"{n:<12}" + ("can be emulated" if not reasons else "INVALID: " + "; ".join(reasons)))
    return 0
