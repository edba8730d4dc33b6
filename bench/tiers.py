"""Storage-tier profiles (published vendor caps) and the ``--tier NAME[@GIB][=PATH]`` specs benchmarks run on.

A profile turns a disk size C (GiB) into the limits the emulator enforces: IOPS = min(base + per_gib * C, max),
throughput likewise, a per-request latency, and the I/O unit the vendor counts one operation by (a request of
``n`` bytes costs ``ceil(n / io_unit)`` operations). Alibaba Cloud states IOPS x I/O size = throughput, i.e. a
request is one operation whatever its size and large requests hit the MB/s cap instead; the guest's block layer
still splits requests at ``max_sectors_kb`` (512 KiB on virtio-blk), which is the unit used for those disks.
AWS counts one operation per 256 KiB on SSD volumes. Latency is the middle of the vendor's stated 4 KiB range.

A tier is either ``measured`` (a real mount: ``--tier ssd=/mnt/ssd``) or ``emulated`` (a profile applied by
:mod:`gpufeed.bench.emulate` on top of the host disk: ``--tier ssd``, ``--tier ssd@2000`` for a 2000 GiB disk).
Disks bought with provisioned performance (AWS gp3) take it after the size: ``--tier gp3@200:iops=6000,mbps=500``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil

from gpufeed.errors import ConfigError

MB = 10**6
MiB = 2**20
KiB = 2**10

#: Disk size assumed when a spec gives none: large enough that ssd/essd-pl1 reach their MB/s cap (as a disk
#: holding ImageNet would), small enough that IOPS stays below the per-disk maximum.
DEFAULT_GIB = 500

#: Alibaba and GCP count a request as one op; the guest block layer splits at 512 KiB (virtio-blk max_sectors_kb).
_BLOCK_SPLIT = 512 * KiB

_ALIBABA_DOC = "Alibaba Cloud ECS docs, 'Block storage performance' (help/en/ecs/user-guide/block-storage-performance)"
_ESSD_DOC = ("Alibaba Cloud ECS docs, 'ESSDs' (PL2: 461-32,768 GiB, min{1,800 + 50 x GiB, 100,000} IOPS, "
             "min{120 + 0.5 x GiB, 750} MB/s; PL3: from 1,261 GiB, up to 1,000,000 IOPS and 4,000 MB/s)")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the emulator enforces: operations/s, bytes/s, seconds per request, bytes per operation."""

    iops: float
    bytes_per_s: float
    latency_s: float
    io_unit: int

    def qd_iops(self, request_bytes: int, queue_depth: int) -> float:
        """Requests/s the profile allows for ``queue_depth`` outstanding requests of ``request_bytes``
        (Little's law bounded by both caps): what the self-test compares the emulator against."""
        ops = max(1, math.ceil(request_bytes / self.io_unit))
        cap = min(self.iops / ops, self.bytes_per_s / request_bytes)
        return min(cap, queue_depth / self.latency_s)


@dataclasses.dataclass(frozen=True)
class Provisioning:
    """Performance bought on top of a disk's baseline (AWS gp3): IOPS and MiB/s up to per-disk maxima, IOPS at
    most ``iops_per_gib`` times the size, MiB/s at most ``mbps_per_iops`` times the IOPS."""

    iops_max: float
    mbps_max: float
    iops_per_gib: float
    mbps_per_iops: float

    def check(self, name: str, size_gib: float, base_iops: float, base_mbps: float, iops: float,
              mbps: float) -> None:
        """Refuse what the vendor would not sell, saying what would be allowed."""
        where = f"--tier {name}@{size_gib:g}:iops={iops:g},mbps={mbps:g}"
        top = max(base_iops, min(self.iops_max, self.iops_per_gib * size_gib))
        if not base_iops <= iops <= top:
            if iops > base_iops and iops <= self.iops_max:
                need = math.ceil(iops / self.iops_per_gib)
                raise ConfigError(f"{where}: {iops:,.0f} IOPS need a {name} disk of at least {need:,} GiB "
                                  f"({self.iops_per_gib:g} IOPS per GiB); a {size_gib:g} GiB one goes up to "
                                  f"{top:,.0f}: raise the size or lower iops=")
            raise ConfigError(f"{where}: a {name} disk has {base_iops:,.0f}-{self.iops_max:,.0f} IOPS; "
                              "change iops=")
        if not base_mbps <= mbps <= min(self.mbps_max, self.mbps_per_iops * iops):
            raise ConfigError(f"{where}: with {iops:,.0f} IOPS a {name} disk can be provisioned with "
                              f"{base_mbps:g}-{min(self.mbps_max, self.mbps_per_iops * iops):g} MiB/s "
                              f"({self.mbps_per_iops:g} MiB/s per IOPS, at most {self.mbps_max:g}); change mbps= "
                              "or raise iops=")


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    product: str
    source: str
    iops_base: float
    iops_per_gib: float
    iops_max: float
    mbps_base: float
    mbps_per_gib: float
    mbps_max: float
    #: bytes in the vendor's "MB": 10**6 (Alibaba) or 2**20 (AWS and GCP publish MiB/s).
    mb: int
    latency_s: float
    latency_range: str
    io_unit: int
    #: the smallest disk the vendor sells of this kind (ESSD PL2 starts at 461 GiB, PL3 at 1,261 GiB)
    min_gib: float = 1
    #: performance that can be bought beyond the size's (AWS gp3), or None
    provisioning: Provisioning | None = None

    def limits(self, size_gib: float = DEFAULT_GIB, iops: float | None = None, mbps: float | None = None) -> Limits:
        """The caps of a disk of ``size_gib``; ``iops``/``mbps`` (in the vendor's MB/s) are provisioned
        performance, for profiles that sell it."""
        base_iops = min(self.iops_base + self.iops_per_gib * size_gib, self.iops_max)
        base_mbps = min(self.mbps_base + self.mbps_per_gib * size_gib, self.mbps_max)
        if iops is not None or mbps is not None:
            if self.provisioning is None:
                raise ConfigError(f"--tier {self.name}: {self.product} has no provisioned performance; its IOPS "
                                  "and MB/s follow from the size alone (write NAME@GIB)")
            iops = base_iops if iops is None else iops
            mbps = base_mbps if mbps is None else mbps
            self.provisioning.check(self.name, size_gib, base_iops, base_mbps, iops, mbps)
            base_iops, base_mbps = iops, mbps
        return Limits(iops=base_iops, bytes_per_s=base_mbps * self.mb, latency_s=self.latency_s,
                      io_unit=self.io_unit)

    def provisioned_for(self, mb_per_s: float, iops: float) -> tuple[float, float, float] | None:
        """The cheapest way to buy ``mb_per_s`` (10^6 bytes) and ``iops`` on a disk that sells provisioned
        performance: ``(GiB, IOPS, MiB/s in the vendor's unit)``, the smallest size that allows the IOPS; ``None``
        beyond the per-disk maxima."""
        prov = self.provisioning
        if prov is None:
            return None
        need_mbps = max(self.mbps_base, math.ceil(mb_per_s * MB / self.mb))
        need_iops = max(self.iops_base, math.ceil(iops), math.ceil(need_mbps / prov.mbps_per_iops))
        if need_mbps > prov.mbps_max or need_iops > prov.iops_max:
            return None
        return float(max(self.min_gib, math.ceil(need_iops / prov.iops_per_gib))), float(need_iops), float(need_mbps)

    def smallest_gib(self, mb_per_s: float, iops: float) -> float | None:
        """The smallest disk of this kind, in whole GiB, that serves ``mb_per_s`` (10^6 bytes) and ``iops``
        by the vendor's formulas; ``None`` when no size reaches them (the per-disk maxima are lower)."""
        need_mbps = mb_per_s * MB / self.mb
        if need_mbps > self.mbps_max or iops > self.iops_max:
            return None
        sizes = [self.min_gib]
        for need, base, per_gib in ((need_mbps, self.mbps_base, self.mbps_per_gib),
                                    (iops, self.iops_base, self.iops_per_gib)):
            if need > base:
                sizes.append(math.ceil((need - base) / per_gib) if per_gib else math.inf)
        size = max(sizes)
        return None if math.isinf(size) else float(math.ceil(size))

    def describe(self, size_gib: float = DEFAULT_GIB, iops: float | None = None, mbps: float | None = None) -> dict:
        lim = self.limits(size_gib, iops, mbps)
        out = {"profile": self.name, "product": self.product, "size_gib": size_gib, "iops": lim.iops,
               "mb_per_s": lim.bytes_per_s / MB, "latency_ms": lim.latency_s * 1e3,
               "latency_range": self.latency_range, "io_unit_kib": lim.io_unit / KiB, "source": self.source}
        if iops is not None or mbps is not None:
            out["provisioned"] = {"iops": lim.iops, "mbps": lim.bytes_per_s / self.mb}
        return out


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("ultra", "Alibaba ultra cloud disk (cloud_efficiency), previous generation", _ALIBABA_DOC,
            1800, 8, 5000, 100, 0.15, 140, MB, 2e-3, "1-3 ms", _BLOCK_SPLIT),
    Profile("ssd", "Alibaba standard SSD cloud disk (cloud_ssd), previous generation", _ALIBABA_DOC,
            1800, 30, 25000, 120, 0.5, 300, MB, 1e-3, "0.5-2 ms", _BLOCK_SPLIT),
    Profile("essd-pl0", "Alibaba ESSD PL0", _ALIBABA_DOC,
            1800, 12, 10000, 100, 0.25, 180, MB, 0.4e-3, "0.3-0.5 ms", _BLOCK_SPLIT, min_gib=40),
    Profile("essd-pl1", "Alibaba ESSD PL1", _ALIBABA_DOC,
            1800, 50, 50000, 120, 0.5, 350, MB, 0.2e-3, "~0.2 ms", _BLOCK_SPLIT, min_gib=20),
    Profile("essd-pl2", "Alibaba ESSD PL2", _ESSD_DOC,
            1800, 50, 100000, 120, 0.5, 750, MB, 0.2e-3, "~0.2 ms", _BLOCK_SPLIT, min_gib=461),
    Profile("essd-pl3", "Alibaba ESSD PL3", _ESSD_DOC,
            1800, 50, 1000000, 120, 0.5, 4000, MB, 0.1e-3, "~0.1 ms", _BLOCK_SPLIT, min_gib=1261),
    Profile("nvme", "Alibaba local NVMe SSD (i2/i3-class), one disk, low end of the published range",
            "Alibaba Cloud ECS docs, 'Local disks' (i2/i3 instance families: 150k-300k+ IOPS, 1-2+ GB/s per disk)",
            150000, 0, 150000, 1000, 0, 1000, MB, 50e-6, "tens of us", 128 * KiB),
    Profile("gp3", "AWS EBS gp3 (3,000 IOPS and 125 MiB/s included; more can be provisioned)",
            "AWS EBS User Guide, 'Amazon EBS volume types' and the EC2 CreateVolume API (gp3: 3,000 IOPS and "
            "125 MiB/s included at any size; provisioned up to 16,000 IOPS at 500 per GiB and 1,000 MiB/s at "
            "0.25 MiB/s per IOPS; SSD ops counted per 256 KiB)",
            3000, 0, 3000, 125, 0, 125, MiB, 1e-3, "single-digit ms", 256 * KiB,
            provisioning=Provisioning(iops_max=16000, mbps_max=1000, iops_per_gib=500, mbps_per_iops=0.25)),
    Profile("pd-balanced", "GCP balanced persistent disk",
            "Google Cloud docs, 'Persistent Disk performance' (pd-balanced: 3,000 IOPS + 6/GiB, "
            "140 MiB/s + 0.28 MiB/s per GiB; per-disk max 80,000 IOPS, 1,200 MiB/s)",
            3000, 6, 80000, 140, 0.28, 1200, MiB, 0.8e-3, "sub-ms to ~1 ms", _BLOCK_SPLIT),
    Profile("pd-ssd", "GCP SSD (performance) persistent disk",
            "Google Cloud docs, 'Persistent Disk performance' (pd-ssd: 6,000 IOPS + 30/GiB, 240 MiB/s + "
            "0.48 MiB/s per GiB; per-instance read max 100,000 IOPS, 1,200 MiB/s)",
            6000, 30, 100000, 240, 0.48, 1200, MiB, 0.5e-3, "sub-ms", _BLOCK_SPLIT),
)}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(f"unknown tier profile {name!r}; choose one of {', '.join(PROFILES)} "
                          "or give a real mount as NAME=PATH") from None


@dataclasses.dataclass(frozen=True)
class TierSpec:
    """One ``--tier``: a real mount (``path`` set, ``mode`` measured) or a profile emulated on the host disk."""

    name: str
    path: str | None = None
    size_gib: float = DEFAULT_GIB
    #: provisioned performance (``gp3@200:iops=6000,mbps=500``), in the vendor's units
    iops: float | None = None
    mbps: float | None = None

    @property
    def mode(self) -> str:
        return "measured" if self.path else "emulated"

    @property
    def profile(self) -> Profile | None:
        return None if self.path else get_profile(self.name)

    @property
    def limits(self) -> Limits | None:
        p = self.profile
        return p.limits(self.size_gib, self.iops, self.mbps) if p else None

    def row_fields(self) -> dict:
        """The tier's part of a result row."""
        fields = {"tier": self.name, "mode": self.mode, "profile": self.name if self.profile else None,
                  "tier_path": self.path}
        if self.profile:
            fields["tier_limits"] = self.profile.describe(self.size_gib, self.iops, self.mbps)
        return fields


def copy_to_mount(src: str, target: str) -> None:
    """Copy the directory ``src`` to ``target`` (on a measured tier's mount) through ``target.partial``, so a
    copy cut short is never taken for a finished one."""
    tmp = target + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    os.replace(tmp, target)


def parse_tier(spec: str) -> TierSpec:
    """``ssd``, ``ssd@2000`` (emulated, disk of 2000 GiB), ``gp3@200:iops=6000,mbps=500`` (with provisioned
    performance) or ``ssd=/mnt/ssd`` (measured on that mount)."""
    base, colon, extra = spec.partition(":")
    if colon and "=" not in base:  # NAME@GIB:iops=...,mbps=... (a mount path may hold ':', after '=')
        name, sep, path = base, "", ""
    else:
        name, sep, path = spec.partition("=")
        extra = ""
    name, at, size = name.partition("@")
    if not name:
        raise ConfigError(f"--tier {spec!r} has no name; write NAME, NAME@GIB or NAME=PATH")
    if sep:
        if not path:
            raise ConfigError(f"--tier {spec!r} has an empty path; write NAME=/mount/point")
        if not os.path.isdir(path):
            raise ConfigError(f"--tier {spec!r}: {path} is not a directory; mount the disk there or fix the path")
        return TierSpec(name=name, path=os.path.abspath(path))
    profile = get_profile(name)
    gib = DEFAULT_GIB
    if at:
        try:
            gib = float(size)
        except ValueError:
            raise ConfigError(f"--tier {spec!r}: disk size {size!r} is not a number of GiB") from None
        if gib <= 0:
            raise ConfigError(f"--tier {spec!r}: disk size must be positive")
    provisioned = {}
    for part in filter(None, extra.split(",")):
        key, eq, value = part.partition("=")
        if key not in ("iops", "mbps") or not eq:
            raise ConfigError(f"--tier {spec!r}: {part!r} is not iops=N or mbps=N; write e.g. "
                              f"{name}@{gib:g}:iops=6000,mbps=500")
        try:
            provisioned[key] = float(value)
        except ValueError:
            raise ConfigError(f"--tier {spec!r}: {key}={value!r} is not a number") from None
    tier = TierSpec(name=name, size_gib=gib, **provisioned)
    if provisioned:
        profile.limits(gib, tier.iops, tier.mbps)  # refuses what the vendor does not sell, saying why
    return tier
