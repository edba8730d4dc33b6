"""The work plan: a seeded global shuffle of each split, cut into contiguous shards.

Sequential readers (TFRecord, a single ``.rec``, LMDB cursors) see records in file order, so the shuffle
happens here, once, at write time. Shard ``i`` of a split is the contiguous range ``bounds[i]`` of the
shuffled order, and a sample's ``index`` is its planned position in the split. Nothing in the plan
depends on the number of workers or nodes, which is what makes the output byte-identical across them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import zlib

import numpy as np

from gpufeed.convert.options import SAMPLES_PER_SHARD


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    split: str
    shard: int
    count: int  # shards in the split
    start: int  # first planned index
    stop: int

    @property
    def id(self) -> str:
        return f"{self.split}-{self.shard:05d}"


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    split: str
    order: np.ndarray  # position -> index into the source's item list
    shards: tuple[ShardPlan, ...]
    digest: str  # identifies the items and their order, journalled so a resume notices a changed source
    #: per shard, a digest of what decides its bytes: each input's key, label and identity (size, mtime
    #: and inode of a file; a tar member's place in its archive...), so a resume notices a replaced input;
    #: empty where the workers digest the shards they convert (local files: no stat per input here)
    shard_digests: tuple[str, ...] = ()
    #: where the plan's last shards are cut finer (:func:`shard_bounds`): the count of equal shards it was
    #: tapered from, journalled so that a resume plans the same bounds; None for equal shards
    tapered_from: int | None = None

    def __len__(self) -> int:
        return len(self.order)


#: A small split is still cut into this many shards (of at least :data:`MIN_SHARD_SAMPLES` each) when no shard
#: size is given, so its conversion runs on several workers: 1,204 images at 1,250 a shard were one shard, and
#: --workers 2 took as long as one. From the split alone, never from the workers: the bytes do not depend on them.
MIN_SHARDS = 16
MIN_SHARD_SAMPLES = 100


def default_shards(n: int, shard_size: int | None = None, per_shard: int = SAMPLES_PER_SHARD) -> int:
    """About ``shard_size`` samples per shard, at least one shard. Without a size: about ``per_shard`` each
    (:data:`SAMPLES_PER_SHARD`, or finer where no shard is a file: ConvertOptions.default_shard_samples), the
    count rounded to a power of two where that makes :data:`MIN_SHARDS` or more (TensorFlow's ImageNet layout: 1,024 train shards of ~1,250 images, where 1,250 each would make 1,025),
    and at least :data:`MIN_SHARDS` of :data:`MIN_SHARD_SAMPLES` or more where the split has the samples for
    them. A power of two splits into whole waves on 16, 32, 64 or 128 workers: 1,025 shards on 64 workers were
    16 waves and one shard that one worker converted alone for ~7 s, and 240 shards 3.75 waves, the last
    quarter leaving 16 workers idle (results/convert-imagenet-h100x4.txt)."""
    if shard_size is not None:
        return max(1, round(n / shard_size))
    k = round(n / per_shard)
    if k >= MIN_SHARDS:
        return 1 << round(math.log2(n / per_shard))
    return max(1, k, min(MIN_SHARDS, n // MIN_SHARD_SAMPLES))


#: Where no shard is a file anyone sees (ConvertOptions.tapers: a single ``.rec`` per split, whose bytes are the
#: same whatever the bounds), the last :data:`TAPER_PART` of a split of :data:`TAPER_MIN_SHARDS` shards or more is
#: cut into shards :data:`TAPER_DIVISOR` times smaller. Equal shards end ragged: on 64 workers the last wave of
#: 1,024 shards of ~293 images (1.2 s each, up to 2 s) left 30-76 worker-seconds idle, 0.5-1.2 s of a 22 s warm
#: run (results/convert-node-h200x4.txt, session 22); the finer shards at the end fill those gaps, and a shard
#: more costs its worker ~2.5 ms. The taper depends on the split alone, never on the workers. A journal records
#: the count a tapered plan was cut from (``tapered_from``), and these constants decide the bounds it stands for:
#: change them together with JOURNAL_VERSION (convert/state.py), or an older journal's resume plans other bounds
#: (version 4 brought the taper in: a gpufeed that reads version 3 refuses a tapered journal instead of misreading it).
TAPER_PART = 8
TAPER_DIVISOR = 4
TAPER_MIN_SHARDS = 64


def shard_bounds(n: int, k: int, taper: bool = False) -> list[tuple[int, int]]:
    """The planned positions ``[start, stop)`` of each shard: ``k`` equal shards (TensorFlow's
    build_imagenet_data.py spacing: shard i covers ``[i*n//k, (i+1)*n//k)``), or with ``taper`` the first
    ``k - k // TAPER_PART`` of those and the rest of the split in ``TAPER_DIVISOR`` times as many shards (all
    ``k`` equal where ``k`` is under ``TAPER_PART``)."""
    if not taper:
        return [(i * n // k, (i + 1) * n // k) for i in range(k)]
    head = k - k // TAPER_PART
    start = head * n // k
    rest = n - start
    fine = min((k - head) * TAPER_DIVISOR, rest)  # no empty shard
    return ([(i * n // k, (i + 1) * n // k) for i in range(head)]
            + [(start + i * rest // fine, start + (i + 1) * rest // fine) for i in range(fine)])


def split_order(n: int, split: str, seed: int, shuffle: bool) -> np.ndarray:
    """A permutation of ``range(n)``; each split gets its own stream so that train and val differ."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, zlib.crc32(split.encode())])
    return rng.permutation(n)


def shard_digest(identities) -> str:
    """What decides a shard's bytes, in a few characters: a digest of its inputs' identities in plan order
    (the driver's when it plans, or the worker's that reads them; the same either way)."""
    sh = hashlib.sha256()
    for identity in identities:
        sh.update(identity)
        sh.update(b"\0")
    return sh.hexdigest()[:32]


def plan_split(split: str, keys: list[str], seed: int, shuffle: bool, shards: int | None,
               shard_size: int | None = None, identities: list[bytes] | None = None,
               per_shard: int = SAMPLES_PER_SHARD, taper: bool = False, taper_min: int | None = None) -> SplitPlan:
    """``identities[i]``: what decides item ``i``'s bytes and label besides its key (see
    :func:`gpufeed.convert.identity.item_identity`), digested per shard; ``None`` where each shard's worker
    digests its inputs as it reads them (``shard_digests`` is then empty). ``taper``: the last shards cut finer
    (:func:`shard_bounds`), for outputs whose bytes do not depend on the bounds, where the split has ``taper_min``
    shards or more (:data:`TAPER_MIN_SHARDS`; 0 for a resume that keeps the taper its journal records)."""
    n = len(keys)
    order = split_order(n, split, seed, shuffle)
    k = min(shards or default_shards(n, shard_size, per_shard), max(n, 1))
    tapered = taper and k >= max(TAPER_PART, TAPER_MIN_SHARDS if taper_min is None else taper_min)
    bounds = shard_bounds(n, k, tapered)
    h = hashlib.sha256()  # each key in plan order, then a NUL: one update (a million keys in ImageNet)
    in_order = np.asarray(keys, dtype=object)[order].tolist()  # numpy's gather: half the time of a loop here
    h.update(("\0".join(in_order) + "\0" if n else "").encode("utf-8", "surrogateescape"))
    shard_digests = ()
    if identities is not None:
        shard_digests = tuple(shard_digest(identities[pos] for pos in order[a:b]) for a, b in bounds)
    count = len(bounds)
    return SplitPlan(split, order, tuple(ShardPlan(split, i, count, a, b) for i, (a, b) in enumerate(bounds)),
                     h.hexdigest(), shard_digests, k if tapered else None)
