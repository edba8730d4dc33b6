"""Coverage-guided fuzzing of the format readers with atheris (libFuzzer for Python).

tests/test_fuzz_readers.py runs a short hypothesis campaign on every test run; this harness is for the longer
runs, guided by coverage of gpufeed's own code. Each input picks a target, then its bytes become that target's
file or record value:

* ``recordio`` / ``tfrecord``: a data file read sequentially and at random (memory-mapped and plain reads),
  ``tfrecord-gzip``: the same bytes as a GZIP shard, ``recordio-idx``: an ``.idx`` beside a valid ``.rec``;
* ``*-decode``: a record value for ``Format.decode`` of each format (LMDB: a Caffe Datum);
* ``lmdb``: only with ``--lmdb-files``, the bytes as an LMDB ``data.mdb`` (crashes found there may be the
  LMDB C library's, which does not check its pages).

Allowed outcomes: a result, or a gpufeed error. Anything else is a finding (libFuzzer writes the input as
``crash-*``). Install and run, e.g. for ten minutes with a corpus directory seeded from valid files::

    pip install -e '.[fuzz]'
    python fuzz/atheris_readers.py -max_total_time=600 -rss_limit_mb=2048 /tmp/gpufeed-fuzz-corpus
    python fuzz/atheris_readers.py crash-<hash>            # replay one finding

The corpus directory is created and seeded with valid outputs of the writers when it is new or empty. A
90-second run here (2 cores) made about 9,000 executions; run it for hours on a spare machine.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import atheris

with atheris.instrument_imports(include=["gpufeed"]):
    from gpufeed.errors import GpufeedError
    from gpufeed.formats import FORMATS, get_format
    from gpufeed.formats.base import Sample

TARGETS = ["recordio", "tfrecord", "tfrecord-gzip", "recordio-idx"] + [f"{n}-decode" for n in FORMATS]
_NAMES = {"recordio": "f.rec", "tfrecord": "f-00000-of-00001", "tfrecord-gzip": "f.gz", "lmdb": "f_lmdb"}
_WORK = tempfile.mkdtemp(prefix="gpufeed-atheris-")


def _samples():
    magic = b"\x0a\x23\xd7\xce"
    return [Sample("a/0.jpg", 0, b"\xff\xd8\xff" + bytes(range(64)) + magic, index=0),
            Sample("b/1.jpg", [1.0, 2.0], b"\xff\xd8\xff" + magic * 3, index=1)]


def _valid(name: str, directory: str) -> str:
    fmt = get_format("tfrecord" if name == "tfrecord-gzip" else name)
    path = os.path.join(directory, _NAMES[name])
    with fmt.writer(path) as w:
        for s in _samples():
            w.write(s)
    return path


def _read_everything(name: str, path: str, use_mmap: bool) -> None:
    fmt = get_format(name)
    opts = {} if name == "lmdb" else {"use_mmap": use_mmap}
    with fmt.reader(path, **opts) as r:
        for _ in r:
            pass
        if r._has_index():
            for i in range(len(r)):
                r[i]


def _fresh_dir() -> str:
    d = os.path.join(_WORK, "case")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def test_one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    # Byte 0 picks the target, byte 1 the read path; the rest is the file or value (easy to seed).
    targets = TARGETS + (["lmdb"] if LMDB_FILES else [])
    target = targets[data[0] % len(targets)]
    use_mmap = bool(data[1] & 1)
    body = data[2:]
    try:
        if target.endswith("-decode"):
            get_format(target[:-len("-decode")]).decode(b"00000000_x", body, "fuzz", 0, 0)
            return
        d = _fresh_dir()
        if target == "recordio-idx":
            path = _valid("recordio", d)
            with open(path[:-4] + ".idx", "wb") as f:
                f.write(body)
            _read_everything("recordio", path, use_mmap)
        elif target == "lmdb":
            path = _valid("lmdb", d)
            with open(os.path.join(path, "data.mdb"), "wb") as f:
                f.write(body)
            _read_everything("lmdb", path, use_mmap)
        else:
            path = os.path.join(d, _NAMES[target])
            with open(path, "wb") as f:
                f.write(body)
            _read_everything("tfrecord" if target == "tfrecord-gzip" else target, path, use_mmap)
    except GpufeedError:
        pass


def _seed(corpus: str) -> None:
    if os.listdir(corpus):
        return
    d = tempfile.mkdtemp(dir=_WORK)
    for i, target in enumerate(TARGETS[:3]):
        path = _valid(target, d)
        with open(path, "rb") as f:
            body = f.read()
        with open(os.path.join(corpus, f"seed-{target}"), "wb") as f:
            f.write(bytes([i, 1]) + body)


LMDB_FILES = "--lmdb-files" in sys.argv


def main() -> None:
    argv = [a for a in sys.argv if a != "--lmdb-files"]
    paths = [a for a in argv[1:] if not a.startswith("-")]
    if paths and not os.path.exists(paths[0]):
        os.makedirs(paths[0])  # a new corpus directory; an existing file is an input to replay
    if paths and os.path.isdir(paths[0]):
        _seed(paths[0])
    atheris.Setup(argv, test_one_input)
    try:
        atheris.Fuzz()
    finally:
        shutil.rmtree(_WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
