"""What a failed write tells the user to do: by the error's errno, naming the filesystem the file is on (a memory
spool's tmpfs is not the destination's disk), with advice that fixes that errno and no other."""

from __future__ import annotations

import errno
import os
import re
import resource

import pytest

from gpufeed.errors import write_fix


def _mount_of(path: str) -> str:
    here = os.path.abspath(path)
    dev = os.stat(here).st_dev
    while os.path.dirname(here) != here and os.stat(os.path.dirname(here)).st_dev == dev:
        here = os.path.dirname(here)
    return here


@pytest.mark.parametrize("code, says", [
    (errno.ENOSPC, "{where} is full: free space there"),
    (errno.EDQUOT, "your disk quota on {where} is used up: free space there or have the quota raised"),
    (errno.EROFS, "{where} is mounted read-only: remount it read-write or choose another destination"),
    (errno.EIO, "the device under {where} failed a write: check it (`dmesg`) before writing there again"),
    (errno.EACCES, "this user may not write in {folder}: fix its permissions or choose another destination"),
    (errno.EPERM, "this user may not write in {folder}: fix its permissions or choose another destination"),
    (errno.EINVAL, "check {where} (free space, permissions, the device)"),
])
def test_each_errno_gets_its_own_advice_naming_the_filesystem(tmp_path, code, says):
    path = str(tmp_path / "out" / "train.rec")  # not made yet: the filesystem of the folder it would be in
    text = write_fix(path, OSError(code, os.strerror(code)))
    # the mount point and its type, as /proc/self/mountinfo gives them
    where = re.escape(_mount_of(tmp_path)) + r" \([\w.]+(, memory)?\)"
    pattern = re.escape(says).replace(re.escape("{where}"), where).replace(re.escape("{folder}"),
                                                                           re.escape(str(tmp_path / "out")))
    assert re.fullmatch(pattern, text), (pattern, text)


def test_a_memory_filesystem_is_named_as_memory(tmp_path):
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm is not a filesystem of its own here")
    text = write_fix("/dev/shm/gpufeed-spool-0-x/train-recordio-00000.rec", OSError(errno.ENOSPC, "full"))
    assert text == "/dev/shm (tmpfs, memory) is full: free space there"


def test_a_file_size_limit_is_named_with_its_value_and_the_way_to_raise_it(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (24 << 10, hard))
    try:
        limited = write_fix(str(tmp_path / "x"), OSError(errno.EFBIG, "File too large"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert limited == "this process may not write a file past 24576 bytes (`ulimit -f` is 24): raise the limit " \
                      "(`ulimit -f unlimited`)"
    if soft == resource.RLIM_INFINITY:  # no limit: the filesystem's own largest file
        text = write_fix(str(tmp_path / "x"), OSError(errno.EFBIG, "File too large"))
        assert text.startswith("the file is larger than ") and "holds in one file: write to another filesystem" in text


def test_lmdbs_error_gives_the_errno_of_its_failed_call(tmp_path):
    """py-lmdb raises its own ``Error`` for a failed system call, the errno in ``code``."""
    import lmdb

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (24 << 10, hard))
    try:
        env = lmdb.open(str(tmp_path / "db"), map_size=1 << 24)
        with pytest.raises(lmdb.Error) as err:
            with env.begin(write=True) as txn:
                for i in range(100):
                    txn.put(b"%d" % i, bytes(1000))
        env.close()
        text = write_fix(str(tmp_path / "db"), err.value)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert err.value.code in (errno.EFBIG, errno.EIO), err.value
    assert text != write_fix(str(tmp_path / "db"), OSError(errno.EINVAL, "x")), text
