"""A FIFO, a device, a socket or a folder where gpufeed reads a file is refused at once, naming the path, what is
there and the fix. Opened as files, a FIFO made every reader wait for a writer without end (the readers, `gpufeed
bench read`, the loader) and a link to /dev/zero read without end; the LMDB reader called a FIFO data.mdb a
truncated file. Each check runs in a forked child (tests/forked.py), which fails the test if it hangs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
from forked import in_child

from gpufeed import io
from gpufeed.bench.dataset import build_dataset, load_dataset_info
from gpufeed.errors import InputError, NotAFileError
from gpufeed.formats import get_format
from gpufeed.pipelines.sources import read_local_file

FORMATS = ("recordio", "lmdb", "tfrecord", "webdataset")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("special") / "ds"
    build_dataset(str(out), FORMATS, n=12, workers=1, resize=32, shards=1)
    return out


def _reader_path(out, fmt: str) -> str:
    """Where the reader of ``fmt`` is pointed in ``out`` (its one train shard or split)."""
    return str(out / load_dataset_info(str(out))["formats"][fmt]["relpaths"][0])


def _copy(built, tmp_path):
    out = tmp_path / "ds"
    shutil.copytree(built, out)
    return out


def _plant(path: str, what: str) -> None:
    """Put ``what`` where the file ``path`` was."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
    if what == "fifo":
        os.mkfifo(path)
    elif what == "zero":
        os.symlink("/dev/zero", path)
    elif what == "dir":
        os.mkdir(path)
    elif what == "socket":
        here = os.getcwd()
        os.chdir(os.path.dirname(path))  # a socket's path has a length limit that the test folders pass
        try:
            s = socket.socket(socket.AF_UNIX)
            s.bind(os.path.basename(path))
            s.close()
        finally:
            os.chdir(here)


KIND = {"fifo": "a FIFO (named pipe)", "zero": "a character device", "dir": "a folder", "socket": "a socket"}


def _read_whole(fmt: str, path: str) -> None:
    reader = get_format(fmt).reader(path)
    len(reader)
    reader[0]
    list(reader)


def _refused(fmt: str, reader_path: str, planted: str, what: str, fix: str) -> None:
    with pytest.raises(NotAFileError) as e:
        _read_whole(fmt, reader_path)
    assert e.value.path == planted and str(e.value).startswith(f"{planted}: is {KIND[what]}, not a regular file; ")
    assert fix in str(e.value)


@pytest.mark.parametrize("what", ["fifo", "zero", "socket", "dir"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_reader_refuses_what_is_no_file_at_its_data_file(built, tmp_path, fmt, what):
    out = _copy(built, tmp_path)
    path = _reader_path(out, fmt)
    data = get_format(fmt).output_files(path)[0]
    _plant(data, what)
    fix = "run `gpufeed convert`" if fmt == "lmdb" else "convert the dataset again or fix the path"
    in_child(_refused, fmt, path, data, what, fix, timeout=30)


#: The files beside each format's data file, by position in its ``output_files`` (1 on).
SIDE_FILES = [(fmt, k) for fmt, n in (("recordio", 3), ("lmdb", 4), ("tfrecord", 1), ("webdataset", 1))
              for k in range(1, n + 1)]


@pytest.mark.parametrize("what", ["fifo", "zero"])
@pytest.mark.parametrize("fmt,k", SIDE_FILES)
def test_a_reader_refuses_what_is_no_file_at_a_file_beside_its_data(built, tmp_path, fmt, k, what):
    out = _copy(built, tmp_path)
    path = _reader_path(out, fmt)
    side = get_format(fmt).output_files(path)[k]
    _plant(side, what)
    in_child(_refused, fmt, path, side, what, "", timeout=30)


def test_bench_read_stops_at_a_fifo_naming_it(built, tmp_path):
    out = _copy(built, tmp_path)
    data = _reader_path(out, "tfrecord")
    _plant(data, "fifo")
    r = subprocess.run([sys.executable, "-m", "gpufeed", "bench", "read", str(out), "--results",
                        str(tmp_path / "r.jsonl"), "--formats", "tfrecord", "--max-seconds", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"gpufeed: error: {data}: is a FIFO (named pipe), not a regular file" in r.stderr


def _loader_refuses(out: str, data: str) -> None:
    import gpufeed

    with pytest.raises(NotAFileError, match="is a FIFO"):
        next(iter(gpufeed.loader(out, format="recordio", split="train", batch_size=4, decode="cpu", workers=0)))


def test_the_loader_stops_at_a_fifo_naming_it(built, tmp_path):
    out = _copy(built, tmp_path)
    data = _reader_path(out, "recordio")
    _plant(data, "fifo")
    in_child(_loader_refuses, str(out), data, timeout=60)


@pytest.mark.parametrize("what", ["fifo", "zero", "socket", "dir"])
def test_open_file_opens_only_regular_files(tmp_path, what):
    path = tmp_path / "f"
    path.write_bytes(b"x")
    link = tmp_path / "link"
    link.symlink_to(path)
    with io.open_file(str(link)) as f:  # a link to a file is a file
        assert f.read() == b"x" and f.name == str(link)
    _plant(str(path), what)

    def check():
        with pytest.raises(IsADirectoryError if what == "dir" else NotAFileError):
            io.open_file(str(path)).close()
        with pytest.raises(IsADirectoryError if what == "dir" else NotAFileError):
            io.open_file(str(path), "r+b").close()

    in_child(check, timeout=30)


def _input_refused(path: str) -> None:
    with pytest.raises(InputError, match="is a FIFO \\(named pipe\\), not a regular file; remove it from the "
                                         "source, or leave it out with --on-error skip"):
        read_local_file(path)


def test_an_input_that_is_a_fifo_when_opened_is_an_input_error(tmp_path):
    """read_local_file looks at nothing before it opens: what it opened is what is checked (a file swapped for a
    FIFO after a look would otherwise be waited on)."""
    path = tmp_path / "x.JPEG"
    os.mkfifo(path)
    in_child(_input_refused, str(path), timeout=30)


def test_a_file_under_another_process_lease_is_read_once_the_lease_is_given_up(tmp_path):
    import fcntl
    import signal

    path = tmp_path / "leased"
    path.write_bytes(b"leased")
    fd = os.open(path, os.O_RDONLY)
    broken = []

    def give_up(signum, frame):  # the kernel asks the holder to give its lease up (SIGIO)
        broken.append(signum)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)

    before = signal.signal(signal.SIGIO, give_up)
    try:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError as e:
            pytest.skip(f"no leases on this filesystem ({e})")
        # A read lease conflicts with an open for writing: the child's open of the file to read and write.
        in_child(_read_and_write_through_a_lease, str(path), timeout=60)
        assert broken == [signal.SIGIO]
    finally:
        signal.signal(signal.SIGIO, before)
        os.close(fd)


def _read_and_write_through_a_lease(path: str) -> None:
    with io.open_file(path, "r+b") as f:  # the open without waiting says EWOULDBLOCK; then it waits for the lease
        assert f.read() == b"leased"


def _appends_refuse(spool: str, folder: str) -> None:
    from gpufeed.formats.assembly import DirectAppend, append_file

    with open(os.path.join(folder, "out.rec"), "w+b") as dst:
        with pytest.raises(NotAFileError, match="is a FIFO"):
            append_file(spool, dst)
    direct = DirectAppend.open(os.path.join(folder, "out.rec"), 0)
    if direct is not None:  # (a filesystem that takes O_DIRECT)
        try:
            with pytest.raises(NotAFileError, match="is a FIFO"):
                direct.append(spool)
        finally:
            direct.close()


def test_the_ordered_outputs_never_wait_on_a_fifo_among_the_spools(tmp_path):
    spool = tmp_path / "train-recordio-00000.rec"
    os.mkfifo(spool)
    in_child(_appends_refuse, str(spool), str(tmp_path), timeout=30)


def test_an_output_is_written_under_a_new_name_never_through_an_entry_already_there(tmp_path, monkeypatch):
    """Outputs are written under a fresh temporary name beside their final one, then renamed: an entry already at
    that name (a symlink to a user's file) is refused, not written through."""
    import uuid

    from gpufeed.errors import OutputError
    from gpufeed.formats.atomic import AtomicFile
    from gpufeed.formats.naming import temp_name

    fixed = uuid.UUID(int=0xABCDEF12 << 96)
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)  # the temporary name, known before it is made
    final = tmp_path / "train.rec"
    victim = tmp_path / "thesis.txt"
    victim.write_bytes(b"a user's file")
    os.symlink(victim, temp_name(str(final)))
    with pytest.raises(OutputError, match="train.rec: cannot be written: something else is already at its new temporary name"):
        AtomicFile(str(final))
    assert victim.read_bytes() == b"a user's file" and not final.exists()
