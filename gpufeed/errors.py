"""One exception tree for all of gpufeed.

Every error says what failed, where (file, record, byte offset) and how to fix it. Subclasses also inherit
the builtin exception a caller would naturally catch (``FileNotFoundError``, ``ValueError``...). All of them
pickle with their arguments intact, so they cross Ray task boundaries unchanged.
"""

from __future__ import annotations

import shlex

#: The command line being run (``["gpufeed", "convert", ...]``), set by the CLI, so that advice can quote
#: the exact command that works; ``None`` when gpufeed is used as a library.
INVOCATION: list[str] | None = None


def rerun_command(add: tuple = (), drop: tuple = ()) -> str:
    """The user's own command with the options ``drop`` removed (flags) and ``add`` appended, quoted for a
    shell; without a known command line, the options alone (``the same command with --no-resume``)."""
    if INVOCATION is None:
        return "the same command" + (f" with {' '.join(add)}" if add else "")
    words = [w for w in INVOCATION if w not in drop]
    return shlex.join(words + [a for a in add if a not in words])


class GpufeedError(Exception):
    """Root of gpufeed's errors. ``str(err)`` is one sentence a person can act on."""

    def __init__(self, *args):
        super().__init__(*args)
        self._init_args = args

    def __reduce__(self):
        return (type(self), self._init_args)


class ConfigError(GpufeedError, ValueError):
    """Options that cannot work together, or a value out of range."""


class InputError(GpufeedError, ValueError):
    """A source input that cannot be used: ``InputError(path, reason, fix=None)``."""

    def __init__(self, path, reason, fix=None):
        super().__init__(path, reason, fix)
        self.path, self.reason, self.fix = str(path), reason, fix

    def __str__(self):
        text = f"{self.path}: {self.reason}"
        return f"{text}; {self.fix}" if self.fix else text


class BadImageError(InputError):
    """An image that cannot be decoded (truncated, corrupt, zero bytes, not an image)."""


class DecompressionBombError(BadImageError):
    """An image whose pixel count exceeds the configured limit."""


class UnsafePickleError(InputError):
    """A pickle that would import or call something other than builtin containers and numpy arrays."""


class UnsafeArchiveError(InputError):
    """A tar member with an absolute path, ``..``, a link or a device file, or a tar bomb."""


class LabelError(InputError):
    """Missing classes, unknown synsets, duplicate keys or undecodable file names."""


class SourceNotFound(GpufeedError, FileNotFoundError):
    """A dataset root or a file it needs does not exist: ``SourceNotFound(path, what, fix=None)``; ``what=None``:
    nothing at all is at ``path``."""

    def __init__(self, path, what, fix=None):
        super().__init__(path, what, fix)
        self.path, self.what, self.fix = str(path), what, fix

    @property
    def reason(self) -> str:
        """What is wrong, without the path or the fix (a summary lists it beside the path, under the fix)."""
        return "does not exist" if self.what is None else f"{self.what} not found"

    def __str__(self):
        text = f"{self.path}: {self.reason}"
        return f"{text}; {self.fix}" if self.fix else text


class ShardNotFound(GpufeedError, FileNotFoundError):
    """An output file named by an index or manifest is missing."""

    def __init__(self, path, fix=None):
        super().__init__(path, fix)
        self.path, self.fix = str(path), fix

    def __str__(self):
        return f"{self.path}: missing" + (f"; {self.fix}" if self.fix else "")


class NotAFileError(GpufeedError, OSError):
    """What is at a file's path (links followed) is no regular file: a FIFO, a device, a socket, a folder.
    ``kind`` names it ("a FIFO (named pipe)"); ``fix`` says what to do where the caller knows better than the
    default (a reader of outputs: convert again)."""

    def __init__(self, path, kind, fix=None):
        super().__init__(path, kind, fix)
        self.path, self.kind, self.fix = str(path), kind, fix
        self.filename = self.path

    #: What to do where the caller says nothing more fitting.
    FIX = "put the file in its place (a link to a file works), or remove it and rerun what writes it"

    def __str__(self):
        return f"{self.path}: is {self.kind}, not a regular file; {self.fix or self.FIX}"


class CorruptRecordError(GpufeedError, ValueError):
    """A record that fails its checks: ``CorruptRecordError(path, record_index, byte_offset, reason)``.

    ``record_index`` is the 0-based position of the record in the file (``None`` when unknown) and
    ``byte_offset`` the position of its first byte.
    """

    def __init__(self, path, record_index, byte_offset, reason="corrupt record"):
        super().__init__(path, record_index, byte_offset, reason)
        self.path, self.record_index, self.byte_offset, self.reason = str(path), record_index, byte_offset, reason

    def __str__(self):
        where = f"record {self.record_index}" if self.record_index is not None else "a record"
        if self.byte_offset is not None:
            where += f" at byte {self.byte_offset}"
        return (f"{self.path}: {where}: {self.reason}; the file is damaged: delete it, then rerun the "
                "`gpufeed convert` command that made it")


class RecordTooLargeError(GpufeedError, ValueError):
    """A record larger than its format allows (RecordIO: 2**29 - 1 bytes)."""

    def __init__(self, key, size, limit, fix=None):
        super().__init__(key, size, limit, fix)
        self.key, self.size, self.limit, self.fix = key, size, limit, fix

    @property
    def reason(self) -> str:
        return f"record {self.key!r} is {self.size} bytes, over the format's limit of {self.limit}"

    def __str__(self):
        return f"{self.reason}; {self.fix}" if self.fix else self.reason


#: Errors that mean "this input is unusable" and fall under ``--on-error``; anything else stops a run. Each
#: has ``reason``: what is wrong with the input, as a summary lists it beside the input's name.
INPUT_ERRORS = (InputError, SourceNotFound, RecordTooLargeError)


class OutputError(GpufeedError, OSError):
    """The destination cannot be written (full disk, unreachable remote, permissions)."""


def make_readable(what: str = "it") -> str:
    """The advice for a file or folder that is there but that the user running gpufeed may not read."""
    return f"make {what} readable by the user running gpufeed (chmod, chown)"


def write_fix(path: str, e: BaseException) -> str:
    """What to do about ``e``, an error writing ``path``, by its errno, naming the filesystem ``path`` is on
    (its mount point and type: a memory spool's ``/dev/shm (tmpfs, memory)`` is not the destination's disk)."""
    import errno
    import os

    code = getattr(e, "errno", None)
    if code is None and isinstance(getattr(e, "code", None), int) and e.code > 0:
        code = e.code  # py-lmdb's Error: the errno of a failed system call (LMDB's own codes are negative)
    where = _filesystem(path)
    if code == errno.ENOSPC:
        return f"{where} is full: free space there"
    if code == errno.EDQUOT:
        return f"your disk quota on {where} is used up: free space there or have the quota raised"
    if code == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return (f"this process may not write a file past {limit} bytes (`ulimit -f` is "
                    f"{limit // 1024}): raise the limit (`ulimit -f unlimited`)")
        return f"the file is larger than {where} holds in one file: write to another filesystem"
    if code in (errno.EACCES, errno.EPERM):
        return (f"this user may not write in {os.path.dirname(os.path.abspath(path))}: fix its permissions or "
                "choose another destination")
    if code == errno.EROFS:
        return f"{where} is mounted read-only: remount it read-write or choose another destination"
    if code == errno.EIO:
        return f"the device under {where} failed a write: check it (`dmesg`) before writing there again"
    return f"check {where} (free space, permissions, the device)"


def _filesystem(path: str) -> str:
    """``/mnt/data (ext4)``: the mount point ``path`` is on and its type (``tmpfs`` said to be memory); the
    folder alone where /proc does not tell."""
    import os

    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    try:
        dev = os.stat(here).st_dev
        while os.path.dirname(here) != here and os.stat(os.path.dirname(here)).st_dev == dev:
            here = os.path.dirname(here)
    except OSError:
        return here
    kind = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:  # the last mount at a point is the one in effect
                fields = line.split()
                sep = fields.index("-")
                if _unescape(fields[4]) == here and os.stat(here).st_dev == dev:
                    kind = fields[sep + 1]
    except (OSError, ValueError, IndexError):
        pass
    if kind is None:
        return here
    return f"{here} ({kind}, memory)" if kind in ("tmpfs", "ramfs") else f"{here} ({kind})"


def _unescape(field: str) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes are octal escapes there."""
    import re

    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


class DestinationError(GpufeedError, FileExistsError):
    """The destination holds files at names a conversion writes that gpufeed cannot prove it wrote (a user's),
    or something other than gpufeed's state where it keeps it: nothing is removed or overwritten."""


class UnsafeManifestError(GpufeedError, ValueError):
    """A manifest or journal found in a destination names something gpufeed never writes there: a path outside
    the destination, through a symlink, or of no format's naming. It is never followed."""


class IncompleteOutputError(GpufeedError, RuntimeError):
    """``gpufeed verify`` found an output that is not complete or not what its manifest says."""


class EmulationInvalid(GpufeedError, RuntimeError):
    """A tier emulation whose host disk is not clearly faster than the profile it emulates."""


class WorkerError(GpufeedError, RuntimeError):
    """A gpufeed error raised in a DataLoader worker process, as the main process receives it. torch hands a
    worker's exception over as text and rebuilds it from that text alone, which gpufeed's errors (built from
    several fields) cannot be: they would arrive as a bare ``RuntimeError`` holding the worker's traceback.
    The worker raises this instead (``"CorruptRecordError: <its message>"``); rebuilt from torch's text, it
    keeps only that line (:func:`gpufeed.formats.torch.relayed`)."""

    _LINE = "gpufeed.errors.WorkerError: "  # how torch's text of the worker's traceback ends

    def __init__(self, text: str):
        at = text.rfind(self._LINE)
        super().__init__(text[at + len(self._LINE):].rstrip() if at >= 0 else text)
