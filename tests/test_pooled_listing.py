"""Listing in a process pool (a conversion's local processes): ImageNet's train tar with its inner tars indexed
there, and a tree's class folders walked there, give the same entries, the same problems in the same order, the
same errors and limits as in one process; the tar's members are kept without an Item made for each."""

from __future__ import annotations

import io
import os
import pickle
import tarfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest
from test_archive_safety import JPEG, make_tar, member

from gpufeed.convert.identity import identities, item_identity
from gpufeed.errors import GpufeedError
from gpufeed.pipelines import open_source
from gpufeed.pipelines import archive
from gpufeed.pipelines.archive import TARS_PER_TASK, ArchiveLimits, index_tar
from gpufeed.pipelines.base import ItemBatch, ListedItems, TarMemberRef, take_items
from gpufeed.pipelines.pooled import Lent, in_order, pieces
from gpufeed.pipelines.sources import read_ref

def nested(entry) -> bool:
    return entry.name.endswith(".tar")


@pytest.fixture(scope="module")
def pool():
    with ProcessPoolExecutor(2, mp_context=get_context("forkserver")) as p:
        yield Lent(p)


def inner(*members) -> bytes:
    buf = io.BytesIO()
    make_tar(buf, list(members))
    return buf.getvalue()


def train_tar(path, damaged: str | None = None):
    """Nine per-class tars (three tasks' worth), members out of name order, refused members in two of them, a
    file and a refused member among the outer tar's members; ``damaged``: that class tar's second header broken."""
    outer = []
    for c in range(3 * TARS_PER_TASK - 3):
        wnid = f"n{c:02d}"
        members = [member(f"{wnid}_{i}.JPEG", JPEG + bytes([c, i])) for i in (2, 0, 1)]
        if c == 2:
            members.insert(1, member("../evil.JPEG", JPEG))
        if c == 5:
            members.append(member("link.JPEG", type_=b"2", linkname="/etc/passwd"))
        data = inner(*members)
        if wnid == damaged:
            data = bytearray(data)
            data[1024 + 148:1024 + 156] = b"9999999\0"
            data = bytes(data)
        outer.append(member(f"{wnid}.tar", data))
        if c == 3:
            outer.append(member("README.txt", b"not a class"))
            outer.append(member("/abs.tar", inner(member("x.JPEG", JPEG))))
    make_tar(path, outer)
    (path.parent / "LOC_synset_mapping.txt").write_text(
        "".join(f"n{c:02d} class {c}\n" for c in range(3 * TARS_PER_TASK - 3)))
    return str(path)


def indexed(url, pool=None, **kw):
    seen = []
    try:
        out = index_tar(url, nested=nested, on_problem=seen.append, pool=pool, **kw)
    except GpufeedError as e:
        out = e
    return [(type(e).__name__, str(e)) for e in seen], (out if not isinstance(out, Exception) else
                                                        (type(out).__name__, str(out)))


def test_a_pool_indexes_the_inner_tars_as_one_process_does(tmp_path, pool):
    url = train_tar(tmp_path / "ILSVRC2012_img_train.tar")
    here, there = indexed(url), indexed(url, pool)
    assert here == there
    problems, entries = there
    assert [p[1].split(".tar::", 1)[1].split(": ")[0] for p in problems] == [
        "n02.tar::../evil.JPEG", "/abs.tar", "n05.tar::link.JPEG"]
    assert [(e.name, inner is not None) for e, inner in entries][:5] == [
        ("n00.tar", True), ("n01.tar", True), ("n02.tar", True), ("n03.tar", True), ("README.txt", False)]
    assert [m.name for m in entries[0][1]] == ["n00_2.JPEG", "n00_0.JPEG", "n00_1.JPEG"]  # archive order
    # Without on_problem the first refused member in archive order is raised, by either.
    with pytest.raises(GpufeedError) as a:
        index_tar(url, nested=nested)
    with pytest.raises(GpufeedError) as b:
        index_tar(url, nested=nested, pool=pool)
    assert str(a.value) == str(b.value) and "evil" in str(a.value)
    # Limits count every tar's members: the same refusal.
    limits = ArchiveLimits(max_members=20)
    assert indexed(url, limits=limits) == indexed(url, pool, limits=limits)
    assert "more than 20 members" in indexed(url, pool, limits=limits)[1][1]


def test_a_damaged_inner_tar_stops_both_after_the_problems_before_it(tmp_path, pool):
    url = train_tar(tmp_path / "ILSVRC2012_img_train.tar", damaged="n06")
    here, there = indexed(url), indexed(url, pool)
    assert here == there
    problems, error = there
    assert len(problems) == 3 and error[0] == "InputError" and "n06.tar: has a damaged header at byte" in error[1]


def test_a_pool_that_cannot_take_work_leaves_it_to_this_process(tmp_path):
    url = train_tar(tmp_path / "ILSVRC2012_img_train.tar")
    closed = ProcessPoolExecutor(1, mp_context=get_context("forkserver"))
    closed.shutdown()
    assert indexed(url, Lent(closed)) == indexed(url)


def test_the_train_tar_lists_its_members_without_an_item_each(tmp_path, pool):
    train_tar(tmp_path / "ILSVRC2012_img_train.tar")
    sources = [open_source("imagenet", str(tmp_path), on_error="skip") for _ in range(2)]
    sources[1].pool = pool
    listed = [s.items("train") for s in sources]
    assert all(isinstance(items, ListedItems) for items in listed)
    assert [s.skipped() for s in sources][0] == [s.skipped() for s in sources][1] and len(sources[0].skipped()) == 4
    items = list(listed[1])
    keys = [it.key for it in items]
    assert keys == sorted(keys) == [f"n{c:02d}/n{c:02d}_{i}.JPEG" for c in range(9) for i in range(3)]
    assert keys == [it.key for it in listed[0]]
    assert all(isinstance(it.ref, TarMemberRef) and it.ref.member == f"{it.key[:3]}.tar/{it.key[4:]}" for it in items)
    assert [read_ref(it.ref) for it in items[:3]] == [JPEG + bytes([0, i]) for i in range(3)]
    assert items[4].label == 1 and items[4].meta == {"synset": "n01", "text": "class 1"}
    # The identities the plan digests: the same bytes as one Item's at a time.
    cache = {}
    assert identities(listed[1]) == [item_identity(it, cache) for it in items]
    # A shard's items as a worker gets them.
    batch = pickle.loads(pickle.dumps(take_items(listed[1], [5, 0])))
    assert isinstance(batch, ItemBatch) and [it.key for it in batch] == [keys[5], keys[0]]
    assert [it.ref for it in batch] == [items[5].ref, items[0].ref]


def _fails_at_five(n: int) -> int:
    if n == 5:
        raise OSError(5, "Input/output error", f"/data/{n}")
    return n * n


@pytest.mark.parametrize("where", ["pool", "here"])
def test_pieces_come_back_in_order_each_with_its_error(pool, where):
    got = list(in_order(pool if where == "pool" else None, pieces, list(range(12)), 2, _fails_at_five))
    assert [r for r, _ in got] == [0, 1, 4, 9, 16, None, 36, 49, 64, 81, 100, 121]
    assert [e.filename for _, e in got if e is not None] == ["/data/5"] and isinstance(got[5][1], OSError)


def test_a_tree_walked_in_a_pool_lists_as_one_process_does(tmp_path, pool):
    root = tmp_path / "folder"
    for c in range(20):
        d = root / "train" / f"n{c:02d}"
        d.mkdir(parents=True)
        for i in (2, 0, 1):
            (d / f"n{c:02d}_{i}.JPEG").write_bytes(JPEG)
    (root / "train" / "n03" / "notes.txt").write_text("x")  # a non-image in a class folder
    (root / "train" / "n07" / "sub").mkdir()
    (root / "train" / "n07" / "sub" / "deep.JPEG").write_bytes(JPEG)
    (root / "train" / "zz_loose.JPEG").write_bytes(JPEG)  # a file outside any class folder
    (root / "train" / "zz_unknown").mkdir()
    (root / "LOC_synset_mapping.txt").write_text("".join(f"n{c:02d} class {c}\n" for c in range(20)))
    sources = [open_source("imagenet", str(root), on_error="skip") for _ in range(2)]
    sources[1].pool = pool
    listed = [[(it.key, it.label, it.ref) for it in s.items("train")] for s in sources]
    assert listed[0] == listed[1] and len(listed[0]) == 61 and ("n07/sub/deep.JPEG", 7) == listed[1][24][:2]
    assert sources[0].skipped() == sources[1].skipped() and len(sources[0].skipped()) == 3
    with pytest.raises(GpufeedError) as a:
        open_source("imagenet", str(root)).items("train")
    failing = open_source("imagenet", str(root))
    failing.pool = pool
    with pytest.raises(GpufeedError) as b:
        failing.items("train")
    assert str(a.value) == str(b.value) and "notes.txt" in str(a.value)


def _where(n: int) -> tuple[int, int]:
    return n, os.getpid()


def test_chunks_are_done_here_until_the_pool_is_up(pool):
    """A conversion's processes start while its driver lists: the listing goes on here until they are up."""
    never = Lent(pool.executor, lambda: False)
    assert {pid for _, pid in (r for r, _ in in_order(never, pieces, list(range(8)), 2, _where))} == {os.getpid()}
    checks = iter([False, False])
    later = Lent(pool.executor, lambda: next(checks, True))
    got = [r for r, _ in in_order(later, pieces, list(range(8)), 2, _where)]
    assert [n for n, _ in got] == list(range(8))
    assert {pid for _, pid in got[:4]} == {os.getpid()} and os.getpid() not in {pid for _, pid in got[4:]}


def test_a_remote_source_lists_in_threads_of_this_process_whatever_pool_it_is_lent(tmp_path, pool):
    """memory:// is this process's own filesystem: another process would find nothing there. A remote source
    lists in threads here (its requests wait on the network): the same items, problems and identities as the
    same files on a local disk listed in one process."""
    import fsspec

    from gpufeed.pipelines.pooled import threads

    (tmp_path / "tar").mkdir()
    train_tar(tmp_path / "tar" / "ILSVRC2012_img_train.tar")
    val_tar(tmp_path / "tar")
    for c in range(12):
        (tmp_path / "tree" / "train" / f"n{c:02d}").mkdir(parents=True)
        (tmp_path / "tree" / "train" / f"n{c:02d}" / f"n{c:02d}_0.JPEG").write_bytes(JPEG)
    (tmp_path / "tree" / "train" / "n03" / "notes.txt").write_text("x")
    (tmp_path / "tree" / "LOC_synset_mapping.txt").write_text("".join(f"n{c:02d} c\n" for c in range(12)))
    fs = fsspec.filesystem("memory")
    for path in tmp_path.rglob("*"):
        if path.is_file():
            fs.pipe(f"/pooled/{path.relative_to(tmp_path)}", path.read_bytes())
    try:
        for layout, splits, n in (("tar", ["train", "val"], 27 + 30), ("tree", ["train"], 12)):
            remote = open_source("imagenet", f"memory://pooled/{layout}", on_error="skip")
            remote.pool = pool
            assert remote._listing_pool() is threads()
            remote.expect(splits)
            local = open_source("imagenet", str(tmp_path / layout), on_error="skip")
            got = [[(it.key, it.label) for it in s.items(split)] for s in (remote, local) for split in splits]
            assert got[:len(splits)] == got[len(splits):] and sum(map(len, got[:len(splits)])) == n
            assert [(s.origin.split(layout, 1)[1], s.reason) for s in remote.skipped()] == \
                [(s.origin.split(layout, 1)[1], s.reason) for s in local.skipped()]
            for split in splits:
                items = remote.items(split)
                assert items[0].ref.url.startswith("memory://")
                assert identities(items, cache={}) == [item_identity(it, {}) for it in items]
    finally:
        fs.rm("/pooled", recursive=True)


def test_each_open_of_a_memory_file_reads_from_its_own_position():
    """fsspec's memory:// hands every open its one stored file object: threads reading one archive at once (its
    members read ahead, its index walked in spans) would move each other's position."""
    import fsspec

    from gpufeed.io import open_file

    fs = fsspec.filesystem("memory")
    fs.pipe("/own-position/a.tar", bytes(range(256)) * 8)
    try:
        a, b = open_file("memory://own-position/a.tar"), open_file("memory://own-position/a.tar")
        a.seek(1000)
        assert b.read(3) == bytes([0, 1, 2]) and a.read(3) == bytes([1000 % 256, 1001 % 256, 1002 % 256])
    finally:
        fs.rm("/own-position", recursive=True)


def val_tar(folder, damaged: bool = False):
    """A flat val tar of 30 images beside the train tar, with a non-image, a member climbing out, a link and an
    unlabelled image among them (``damaged``: the 20th header broken), and its ``val_labels.txt``."""
    members = [member(f"ILSVRC2012_val_{i:08d}.JPEG", JPEG + bytes([i])) for i in range(1, 31)]
    members[3:3] = [member("notes.txt", b"x"), member("../evil.JPEG", JPEG)]
    members[12:12] = [member("link.JPEG", type_=b"2", linkname="/etc/passwd"),
                      member("ILSVRC2012_val_00000099.JPEG", JPEG)]
    buf = io.BytesIO()
    make_tar(buf, members)
    data = bytearray(buf.getvalue())
    if damaged:
        buf.seek(0)
        with tarfile.open(fileobj=buf) as t:
            at = t.getmembers()[19].offset
        data[at + 124:at + 136] = b"zzzzzzzzzzz\0"  # its size field
    (folder / "ILSVRC2012_img_val.tar").write_bytes(bytes(data))
    (folder / "val_labels.txt").write_text("".join(f"ILSVRC2012_val_{i:08d}.JPEG n{i % 9:02d}\n" for i in range(1, 31)))


def listed_both(folder, pool, on_error="skip"):
    """Each split of ``folder`` listed here, and with ``pool`` as a conversion lists them (``expect`` first): keys,
    labels and refs of each split, what was skipped, or the error; and the val tar's work lent ahead."""
    out, lent = [], None
    for p in (None, pool):
        source = open_source("imagenet", str(folder), on_error=on_error)
        source.pool = p
        source.expect(["train", "val"])
        lent = lent or source._val_ahead
        try:
            got = [[(it.key, it.label, it.ref) for it in source.items(s)] for s in ("train", "val")]
        except GpufeedError as e:
            got = (type(e).__name__, str(e))
        out.append((got, source.skipped()))
    return out, lent


def test_the_val_tar_is_indexed_in_a_pool_while_the_train_tar_is_listed(tmp_path, pool):
    train_tar(tmp_path / "ILSVRC2012_img_train.tar")
    val_tar(tmp_path)
    (here, there), lent = listed_both(tmp_path, pool)
    assert lent is not None and all(later.future is not None for later in lent[1])  # it went to the pool
    assert here == there
    (train, val), skipped = there
    assert len(train) == 27 and len(val) == 30 and val[0][:2] == ("ILSVRC2012_val_00000001.JPEG", 1)
    assert [s.origin.rsplit("::", 1)[-1] for s in skipped[4:]] == [  # the index's refusals, then the listing's
        "../evil.JPEG", "link.JPEG", "notes.txt", "ILSVRC2012_val_00000099.JPEG"]
    # Under --on-error fail, the same first problem stops both: the train tar's, then (train alone good) the val's.
    (here, there), _ = listed_both(tmp_path, pool, on_error="fail")
    assert here == there and "evil.JPEG" in here[0][1]


def test_a_damaged_val_tar_stops_both_after_the_problems_before_it(tmp_path, pool):
    train_tar(tmp_path / "ILSVRC2012_img_train.tar")
    val_tar(tmp_path, damaged=True)
    (here, there), _ = listed_both(tmp_path, pool)
    assert here == there
    error, skipped = here
    assert error[0] == "InputError" and "_val.tar: has a damaged header at byte 18944 (checksum mismatch)" in error[1]
    # The train tar's four, then the two members the val tar's index refused before its damaged header.
    assert [s.origin.rsplit("::", 1)[-1] for s in skipped[4:]] == ["../evil.JPEG", "link.JPEG"]


def test_work_lent_ahead_waits_for_the_processes_or_is_done_here(pool):
    never = Lent(pool.executor, lambda: False)
    job = never.later(_where, 1)
    assert job.future is None and job.result() == ((1, os.getpid()))  # the processes never came: done here
    checks = iter([False])
    soon = Lent(pool.executor, lambda: next(checks, True))
    job = soon.later(_where, 2)
    assert job.future is None
    assert [r for r, _ in in_order(soon, pieces, [0], 1, _where)] == [(0, os.getpid())]
    assert job.future is not None and job.result()[1] != os.getpid()  # handed over by the listing that saw them up
    closed = ProcessPoolExecutor(1, mp_context=get_context("forkserver"))
    closed.shutdown()
    assert Lent(closed).later(_where, 3).result() == (3, os.getpid())  # a pool that cannot take it


def flat_tar(path, damaged_at: int | None = None, global_pax: bool = False) -> str:
    """A flat tar of every kind of header a walk meets: plain members of many sizes, a member that is itself a tar
    (headers inside image bytes, on block boundaries), long names as pax and as GNU records, a directory, members
    refused (a link, a name climbing out), a member longer than several spans; ``global_pax``: a pax global header
    first (fields in force for every member after it); ``damaged_at``: that member's header broken."""
    blocks = []

    def add(info, data=b"", fmt=tarfile.GNU_FORMAT):
        info.size = len(data) if info.type in (tarfile.REGTYPE, tarfile.AREGTYPE) else 0
        blocks.append(info.tobuf(fmt) + data + bytes(-len(data) % 512))

    if global_pax:
        blocks.append(tarfile.TarInfo.create_pax_global_header({"comment": "made here"}))
    for i in range(60):
        name = f"ILSVRC2012_val_{i:08d}.JPEG"
        if i == 7:
            add(tarfile.TarInfo(name), inner(member("a.JPEG", JPEG), member("b.JPEG", JPEG * 40)))
        elif i in (11, 31):
            add(tarfile.TarInfo("long/" * 30 + name), JPEG + bytes([i]) * 700, tarfile.PAX_FORMAT)
        elif i in (12, 47):
            add(tarfile.TarInfo("gnu/" * 40 + name), JPEG + bytes([i]) * 900, tarfile.GNU_FORMAT)
        elif i == 20:
            d = tarfile.TarInfo("a_folder")
            d.type = tarfile.DIRTYPE
            add(d)
        elif i == 25:
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
            add(link)
        elif i == 33:
            add(tarfile.TarInfo("../evil.JPEG"), JPEG)
        elif i == 40:
            add(tarfile.TarInfo(name), JPEG + bytes(range(256)) * 90)  # ~23 KB: several spans
        else:
            add(tarfile.TarInfo(name), JPEG + bytes([i]) * (97 * i % 3000))
    data = bytearray(b"".join(blocks) + bytes(1024))
    if damaged_at is not None:
        at = sum(len(b) for b in blocks[:damaged_at + global_pax])
        data[at + 100:at + 108] = b"9999999\0"  # its mode: the checksum no longer sums
    path.write_bytes(bytes(data))
    return str(path)


def flat_indexed(url, pool=None, collect=True):
    seen = []
    try:
        out = index_tar(url, on_problem=seen.append if collect else None, pool=pool)
    except GpufeedError as e:
        out = e
    return [(type(e).__name__, str(e)) for e in seen], (out if not isinstance(out, Exception) else
                                                        (type(out).__name__, str(out)))


@pytest.mark.parametrize("span", [1536, 2560, 4096, 7000, 30000])
@pytest.mark.parametrize("kind", ["plain", "global pax", "damaged", "refused is the error"])
def test_a_flat_tar_walked_in_spans_indexes_as_one_walk(tmp_path, pool, monkeypatch, span, kind):
    url = flat_tar(tmp_path / "ILSVRC2012_img_val.tar", damaged_at=44 if kind == "damaged" else None,
                   global_pax=kind == "global pax")
    monkeypatch.setattr(archive, "SPAN_BYTES", span)
    assert len(archive._spans(os.path.getsize(url))) > 1
    collect = kind != "refused is the error"
    here = flat_indexed(url, collect=collect)
    assert flat_indexed(url, pool, collect=collect) == here
    problems, out = here
    if kind == "damaged":
        assert out[0] == "InputError" and "has a damaged header at byte" in out[1] and len(problems) == 2
    elif kind == "refused is the error":
        assert problems == [] and out[0] == "UnsafeArchiveError" and "symbolic link" in out[1]
    else:
        assert [name for name, _, _ in (e for e, _ in out)][:1] == ["ILSVRC2012_val_00000000.JPEG"]
        assert len(out) == 57 and len(problems) == 2 and "long/long/" in out[11][0][0] and "gnu/gnu/" in out[12][0][0]


def test_a_flat_tar_begun_ahead_is_walked_here_where_the_processes_never_came(tmp_path, pool, monkeypatch):
    url = flat_tar(tmp_path / "ILSVRC2012_img_val.tar")
    monkeypatch.setattr(archive, "SPAN_BYTES", 4096)
    here = flat_indexed(url)
    for ready in (False, True):
        lent = Lent(pool.executor, lambda: ready)
        ahead = archive.index_ahead(url, lent)
        assert all((later.future is not None) == ready for later in ahead[1])
        seen = []
        out = index_tar(url, on_problem=seen.append, ahead=ahead)
        assert ([(type(e).__name__, str(e)) for e in seen], out) == here
        assert not lent._waiting  # nothing left for the pool to take later


def test_the_val_tar_listed_alone_is_walked_in_spans_by_the_pool(tmp_path, pool, monkeypatch):
    train_tar(tmp_path / "ILSVRC2012_img_train.tar")
    val_tar(tmp_path)
    monkeypatch.setattr(archive, "SPAN_BYTES", 2048)
    listed = []
    for p in (None, pool):
        source = open_source("imagenet", str(tmp_path), on_error="skip")
        source.pool = p
        listed.append(([(it.key, it.label, it.ref) for it in source.items("val")], source.skipped()))
    assert listed[0] == listed[1] and len(listed[0][0]) == 30 and len(listed[0][1]) == 4


@pytest.mark.parametrize("where", ["pool", "here"])
def test_a_listing_says_how_far_it_is(tmp_path, pool, monkeypatch, where):
    """Where something listens (a conversion's progress), a long listing says how many class tars, class folders
    or parts of the val tar are done: as many lines as pieces here, the progress keeping one every few seconds."""
    train_tar(tmp_path / "ILSVRC2012_img_train.tar")
    val_tar(tmp_path)
    monkeypatch.setattr(archive, "SPAN_BYTES", 4096)
    source = open_source("imagenet", str(tmp_path), on_error="skip")
    source.pool = pool if where == "pool" else None
    said = []
    source.tell = said.append
    source.expect(["train", "val"])
    source.items("train"), source.items("val")
    url = str(tmp_path)
    train = [s for s in said if "_train.tar" in s]
    counted = "9 of 9" if where == "pool" else "9"  # (here the count is known only at the end)
    assert train[-1] == f"listing {url}/ILSVRC2012_img_train.tar: {counted} class tars indexed"
    val = [s for s in said if "_val.tar" in s]
    if where == "pool":  # (listed here, a flat tar is one walk: nothing to count)
        n = len(archive._spans(os.path.getsize(tmp_path / "ILSVRC2012_img_val.tar")))
        assert len(val) == n > 1 and val[-1] == f"listing {url}/ILSVRC2012_img_val.tar: {n} of {n} parts indexed"
    tree = tmp_path / "tree"
    for c in range(3):
        (tree / "train" / f"n{c:02d}").mkdir(parents=True)
        (tree / "train" / f"n{c:02d}" / "a.JPEG").write_bytes(JPEG)
    said.clear()
    source = open_source("folder", str(tree), on_error="skip")
    source.pool, source.tell = (pool if where == "pool" else None), said.append
    source.items("train")
    assert said[-1] == f"listing {tree}/train: 3 of 3 class folders listed"


def test_the_progress_says_a_listing_every_few_seconds_and_never_over_the_bar():
    from gpufeed.convert.progress import Progress

    out = io.StringIO()
    quiet = Progress(file=out, log_interval=3600)
    quiet.phase("listing SRC")
    quiet.listing("listing SRC: 1 of 9 class tars indexed")  # sooner than the interval: nothing more
    loud = Progress(file=out, log_interval=0)
    loud.phase("listing SRC")
    loud.listing("listing SRC: 2 of 9 class tars indexed")
    assert out.getvalue() == "listing SRC ...\nlisting SRC ...\nlisting SRC: 2 of 9 class tars indexed\n"


def _random_tar(rng) -> bytes:
    """A tar of 1-40 members in GNU, pax or ustar headers: random bytes, tars (headers inside a member's data),
    long names, a link now and then, a pax global header at times; a byte flipped in one of five."""
    blocks = [tarfile.TarInfo.create_pax_global_header({"c": "x"})] if rng.random() < 0.1 else []
    for i in range(rng.randint(1, 40)):
        if rng.random() < 0.1:
            data = inner(*[member(f"in{j}" * rng.randint(1, 40), rng.randbytes(rng.randint(0, 3000)))
                           for j in range(rng.randint(1, 4))])
        else:
            data = rng.randbytes(rng.choice([0, 10, 511, 512, 513, rng.randint(0, 20000)]))
        info = tarfile.TarInfo("d/" * rng.randint(0, 70) + f"m{i}.JPEG")
        info.size = len(data)
        if rng.random() < 0.05:
            info.type, info.linkname, info.size, data = tarfile.SYMTYPE, "x", 0, b""
        try:
            head = info.tobuf(rng.choice([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT]))
        except ValueError:  # a name ustar cannot hold
            head = info.tobuf(tarfile.GNU_FORMAT)
        blocks.append(head + data + bytes(-len(data) % 512))
    raw = bytearray(b"".join(blocks) + bytes(1024))
    if rng.random() < 0.2:
        raw[rng.randrange(len(raw))] ^= 0xFF
    return bytes(raw)


def test_random_tars_walked_in_spans_index_as_one_walk(tmp_path, monkeypatch):
    """Whatever the bytes, spans walked apart and joined give one walk's index: its entries, problems and error."""
    import random

    rng = random.Random(3)
    for n in range(120):
        url = str(tmp_path / f"{n}.tar")
        with open(url, "wb") as f:
            f.write(_random_tar(rng))
        collect = rng.random() < 0.7
        one = flat_indexed(url, collect=collect)
        for span in (512, 1536, 8192):
            monkeypatch.setattr(archive, "SPAN_BYTES", span)
            spans = archive._spans(os.path.getsize(url))
            walked = [archive._index_span(url, lo, hi, ArchiveLimits(), collect) for lo, hi in spans]
            (members, problems), error = archive._merge_spans(url, spans, iter(walked), ArchiveLimits(), collect)
            seen = [(type(e).__name__, str(e)) for _, e in problems]
            got = (type(error).__name__, str(error)) if error is not None else [(m, None) for m in members]
            if not collect and problems:  # (without on_problem the first refusal is the error: none collected)
                raise AssertionError(problems)
            assert (seen, got) == one, (n, span)
