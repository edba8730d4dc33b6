"""Hostile tars: escaping paths, links, devices and bombs are refused; nothing is ever written or followed."""

from __future__ import annotations

import gzip
import io
import os
import tarfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufeed.errors import InputError, LabelError, UnsafeArchiveError
from gpufeed.pipelines import open_source
from gpufeed.pipelines.archive import ArchiveLimits, _headers, index_tar, stream_tar
from gpufeed.pipelines.sources import read_ref

JPEG = b"\xff\xd8\xff\xe0" + b"x" * 100 + b"\xff\xd9"


def member(name, data=b"", type_=tarfile.REGTYPE, linkname=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = type_, linkname, len(data) if type_ == tarfile.REGTYPE else 0
    return info, io.BytesIO(data) if type_ == tarfile.REGTYPE else None


def make_tar(path, members, fmt=tarfile.GNU_FORMAT):
    target = {"fileobj": path} if isinstance(path, io.BytesIO) else {"name": path}
    with tarfile.open(mode="w", format=fmt, **target) as tar:
        for info, data in members:
            tar.addfile(info, data)


HOSTILE = {
    "../evil.JPEG": (member("../evil.JPEG", JPEG), "climbs out"),
    "/etc/evil.JPEG": (member("/etc/evil.JPEG", JPEG), "absolute"),
    "a/../../evil.JPEG": (member("a/../../evil.JPEG", JPEG), "climbs out"),
    "sym.JPEG": (member("sym.JPEG", type_=tarfile.SYMTYPE, linkname="/etc/passwd"), "symbolic link"),
    "hard.JPEG": (member("hard.JPEG", type_=tarfile.LNKTYPE, linkname="ok.JPEG"), "hard link"),
    "dev.JPEG": (member("dev.JPEG", type_=tarfile.CHRTYPE), "device"),
    "fifo.JPEG": (member("fifo.JPEG", type_=tarfile.FIFOTYPE), "device or fifo"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_member_is_refused_or_skipped(tmp_path, name):
    (info, data), why = HOSTILE[name]
    archive = tmp_path / "ILSVRC2012_img_val.tar"
    make_tar(archive, [member("ILSVRC2012_val_00000001.JPEG", JPEG), (info, data)])
    with pytest.raises(UnsafeArchiveError, match=why):
        index_tar(str(archive))
    seen = []
    entries = index_tar(str(archive), on_problem=seen.append)
    assert [e.name for e, _ in entries] == ["ILSVRC2012_val_00000001.JPEG"] and len(seen) == 1

    (tmp_path / "val_labels.txt").write_text("ILSVRC2012_val_00000001.JPEG n01\n")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(UnsafeArchiveError, match=why):
        open_source("imagenet", str(tmp_path)).items("val")
    src = open_source("imagenet", str(tmp_path), on_error="skip")
    assert [read_ref(it.ref) for it in src.items("val")] == [JPEG]
    assert why in src.skipped()[0].reason and "ILSVRC2012_img_val.tar" in src.skipped()[0].origin
    # Indexing never extracts: the folder (and its parent) hold exactly what they held.
    assert sorted(os.listdir(tmp_path)) == before and not (tmp_path.parent / "evil.JPEG").exists()


def test_hostile_member_inside_an_inner_class_tar(tmp_path):
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w") as tar:
        for info, data in (member("n01_1.JPEG", JPEG), member("n01_2.JPEG", type_=tarfile.SYMTYPE, linkname="/")):
            tar.addfile(info, data)
    make_tar(tmp_path / "ILSVRC2012_img_train.tar", [member("n01.tar", inner.getvalue())])
    with pytest.raises(UnsafeArchiveError, match=r"n01.tar::n01_2.JPEG: is a symbolic link"):
        open_source("imagenet", str(tmp_path)).items("train")
    src = open_source("imagenet", str(tmp_path), on_error="skip")
    assert [it.key for it in src.items("train")] == ["n01/n01_1.JPEG"]
    assert read_ref(src.items("train")[0].ref) == JPEG


def test_member_count_bomb_is_refused(tmp_path):
    make_tar(tmp_path / "bomb.tar", [member(f"{i}.JPEG", b"x") for i in range(60)])
    with pytest.raises(UnsafeArchiveError, match="more than 50 members"):
        index_tar(str(tmp_path / "bomb.tar"), limits=ArchiveLimits(max_members=50))
    # Nested tars count against the same budget as their outer tar.
    inner = io.BytesIO()
    make_tar(inner, [member(f"n01_{i}.JPEG", b"x") for i in range(30)])
    make_tar(tmp_path / "ILSVRC2012_img_train.tar", [member(f"n0{k}.tar", inner.getvalue()) for k in range(2)])
    with pytest.raises(UnsafeArchiveError, match="more than 50 members"):
        open_source("imagenet", str(tmp_path), limits=ArchiveLimits(max_members=50)).items("train")


def test_size_bomb_is_refused(tmp_path):
    make_tar(tmp_path / "big.tar", [member(f"{i}.JPEG", b"x" * 4000) for i in range(5)])
    with pytest.raises(UnsafeArchiveError, match="more than 10000 bytes in all"):
        index_tar(str(tmp_path / "big.tar"), limits=ArchiveLimits(max_total_size=10_000))
    with pytest.raises(UnsafeArchiveError, match="declares 4000 bytes"):
        index_tar(str(tmp_path / "big.tar"), limits=ArchiveLimits(max_member_size=1000))


def forged_size_tar(size: int) -> bytes:
    """One member whose header claims ``size`` bytes, followed by only 1 KiB of data."""
    info = tarfile.TarInfo("huge.JPEG")
    info.size = size
    return info.tobuf(tarfile.GNU_FORMAT) + b"\0" * 1024


def test_forged_sizes_are_refused_not_trusted(tmp_path):
    (tmp_path / "claims64g.tar").write_bytes(forged_size_tar(64 * 2 ** 30))
    with pytest.raises(UnsafeArchiveError, match="over the limit"):
        index_tar(str(tmp_path / "claims64g.tar"))
    (tmp_path / "claims1m.tar").write_bytes(forged_size_tar(2 ** 20))
    with pytest.raises(InputError, match="runs past the end of the archive"):
        index_tar(str(tmp_path / "claims1m.tar"))


def test_gzip_stream_bomb_and_escape_are_refused(tmp_path):
    raw = io.BytesIO()
    make_tar(raw, [member(f"d/{i}", b"\0" * 10_000) for i in range(20)] + [member("../../x", b"1")])
    path = tmp_path / "bomb.tar.gz"
    path.write_bytes(gzip.compress(raw.getvalue()))
    with pytest.raises(UnsafeArchiveError, match="more than 100000 bytes"):
        list(stream_tar(str(path), lambda n: True, limits=ArchiveLimits(max_total_size=100_000)))
    with pytest.raises(UnsafeArchiveError, match="climbs out"):
        list(stream_tar(str(path), lambda n: False))
    with pytest.raises(UnsafeArchiveError, match="d/0: declares 10000 bytes, more than the 5000 read"):
        list(stream_tar(str(path), lambda n: True, limits=ArchiveLimits(max_read_size=5000)))
    path.write_bytes(gzip.compress(raw.getvalue())[:-300])
    with pytest.raises(InputError, match="cannot be read to the end"):
        list(stream_tar(str(path), lambda n: True, on_problem=lambda e: None))


def test_damaged_header_names_the_archive(tmp_path):
    make_tar(tmp_path / "ok.tar", [member("a.JPEG", JPEG), member("b.JPEG", JPEG)])
    data = bytearray((tmp_path / "ok.tar").read_bytes())
    data[1024 + 148:1024 + 156] = b"9999999\0"  # second header's checksum
    (tmp_path / "bad.tar").write_bytes(bytes(data))
    with pytest.raises(InputError, match="bad.tar: has a damaged header at byte 1024"):
        index_tar(str(tmp_path / "bad.tar"))


def test_inner_tar_without_end_marker_stays_inside_its_bytes(tmp_path):
    inner = io.BytesIO()
    make_tar(inner, [member("n01_1.JPEG", JPEG)])
    # Cut the inner tar right after its member: no end-of-archive blocks, so the next bytes in the outer
    # tar are the header of the outer tar's next member, which must not be taken for one of n01's images.
    cut = inner.getvalue()[:512 + -(-len(JPEG) // 512) * 512]
    make_tar(tmp_path / "ILSVRC2012_img_train.tar", [member("n01.tar", cut), member("n02.tar", inner.getvalue())])
    src = open_source("imagenet", str(tmp_path))
    assert [it.key for it in src.items("train")] == ["n01/n01_1.JPEG", "n02/n01_1.JPEG"]
    assert [read_ref(it.ref) for it in src.items("train")] == [JPEG, JPEG]


def test_non_utf8_member_name_is_a_label_error(tmp_path):
    path = tmp_path / "ILSVRC2012_img_val.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape") as tar:
        info, data = member("caf\udce9.JPEG", JPEG)  # the raw byte 0xE9 (Latin-1), invalid as UTF-8
        tar.addfile(info, data)
    with pytest.raises(LabelError, match=r"caf\\xe9.JPEG.*not UTF-8"):
        index_tar(str(path))


_names = st.lists(st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=60),
                  min_size=1, max_size=3).map("/".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(members=st.lists(st.tuples(_names, st.sampled_from("fdl"), st.integers(0, 1500)), min_size=1, max_size=6),
       fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT]))
def test_header_index_agrees_with_tarfile(members, fmt):
    """The fast header parser sees what tarfile sees: names (long, unicode, pax), types, sizes, data offsets."""
    raw = io.BytesIO()
    try:
        with tarfile.open(fileobj=raw, mode="w", format=fmt) as tar:
            for name, kind, size in members:
                info = tarfile.TarInfo(name)
                if kind == "f":
                    info.size = size
                    tar.addfile(info, io.BytesIO(bytes(size)))
                else:
                    info.type = tarfile.DIRTYPE if kind == "d" else tarfile.SYMTYPE
                    info.linkname = "" if kind == "d" else name[::-1]
                    tar.addfile(info)
    except ValueError:
        return  # a name this format cannot hold (ustar: too long, non-ASCII); tarfile refuses to write it
    data = raw.getvalue()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        expected = [(m.name, m.type, m.size if m.isreg() else 0, m.offset_data, m.linkname) for m in tar.getmembers()]
    got = [(m.name, m.type, m.size if m.type in (tarfile.REGTYPE, tarfile.AREGTYPE) else 0, m.offset_data,
            m.linkname) for m in _headers(io.BytesIO(data), 0, len(data), "t.tar")]
    assert got == expected
