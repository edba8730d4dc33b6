"""Load untrusted pickles (the CIFAR python batches) without letting them run code.

A pickle can name any importable callable and call it on load, so ``pickle.load`` on a downloaded file is
remote code execution. :func:`load` allows only what the CIFAR files need: builtin containers and scalars
(which need no lookup at all) and the few numpy callables that rebuild an array from its bytes. Any other
global (``os.system``, ``builtins.eval``, ``subprocess.Popen``...) raises :class:`UnsafePickleError` before
it is even imported.
"""

from __future__ import annotations

import io
import pickle

import numpy as np

from gpufeed.errors import InputError, UnsafePickleError


_RECONSTRUCT = np.ndarray.__reduce__(np.zeros(1))[0]


def _numpy_globals() -> dict[tuple[str, str], object]:
    # Taken from numpy's own reducers, so the objects are right for numpy 1 and 2 alike.
    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]
    scalar = np.float64(1).__reduce__()[0]
    frombuffer = np.zeros(1).__reduce_ex__(5)[0]
    out = {}
    # Files written by numpy 1 (and the official CIFAR files, from Python 2) say ``numpy.core``;
    # files written by numpy 2 say ``numpy._core``.
    for core in ("numpy.core", "numpy._core"):
        out[(f"{core}.multiarray", "_reconstruct")] = reconstruct
        out[(f"{core}.multiarray", "scalar")] = scalar
        out[(f"{core}.numeric", "_frombuffer")] = frombuffer
    out[("numpy", "ndarray")] = np.ndarray
    out[("numpy", "dtype")] = np.dtype
    return out


def _latin1_encode(text, encoding="latin1"):
    """``_codecs.encode`` as Python 3 uses it for ``bytes`` in protocol-2 pickles, and nothing else."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r} is not allowed")
    return text.encode("latin1")


_BUILTINS = {name: getattr(__import__("builtins"), name)
             for name in ("set", "frozenset", "bytearray", "complex")}


class _SafeUnpickler(pickle.Unpickler):
    """``size``: the pickle's own size, which bounds what one object it asks for may take (1 MiB at least):
    arrays and bytes of real data arrive in the stream, so only a request for an empty one of a given size can
    ask for more, as a 51-byte pickle asking for ``bytearray(2**31)`` would."""

    def __init__(self, file, where: str, size: int):
        super().__init__(file, encoding="bytes")
        self.where, self.size, self.limit = where, size, max(size, 1 << 20)
        self.allowed = _numpy_globals()
        self.allowed.update({("builtins", n): f for n, f in _BUILTINS.items()})
        self.allowed.update({("__builtin__", n): f for n, f in _BUILTINS.items()})
        self.allowed[("_codecs", "encode")] = _latin1_encode
        unpickler = self

        class _Ndarray(np.ndarray):
            """``numpy.ndarray`` as the pickle names it: the type ``_reconstruct`` is given (then a plain
            ndarray is made), or a call that makes a plain ndarray of a size checked first."""

            def __new__(cls, shape, dtype=float, *args, **kwargs):
                nbytes = unpickler._nbytes(shape, dtype)
                if nbytes > unpickler.limit:
                    raise unpickler._refuse("an array", nbytes)
                return np.ndarray(shape, dtype, *args, **kwargs)

        self._ndarray_type = _Ndarray
        sized = {"bytearray": self._bytearray, "_reconstruct": self._reconstruct, "ndarray": _Ndarray}
        for key in list(self.allowed):
            if key[1] in sized:
                self.allowed[key] = sized[key[1]]

    def _refuse(self, what: str, nbytes: int):
        return UnsafePickleError(self.where, f"is a {self.size}-byte pickle asking for {what} of {nbytes} bytes "
                                 f"(at most {self.limit} are allowed: real data arrives in the file itself), refused "
                                 "before anything was allocated", "use the official dataset file")

    def _bytearray(self, *args):
        if args and isinstance(args[0], int) and args[0] > self.limit:
            raise self._refuse("an empty bytearray", args[0])
        return bytearray(*args)

    def _nbytes(self, shape, dtype) -> int:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = np.dtype(dtype if not isinstance(dtype, bytes) else dtype.decode("latin1")).itemsize
        for d in shape:
            n *= max(int(d), 0)
        return n

    def _reconstruct(self, subtype, shape, dtype):
        nbytes = self._nbytes(shape, dtype)
        if nbytes > self.limit:
            raise self._refuse("an empty array", nbytes)
        return _RECONSTRUCT(np.ndarray if subtype is self._ndarray_type else subtype, shape, dtype)

    def find_class(self, module, name):
        found = self.allowed.get((module, name))
        if found is None:
            raise UnsafePickleError(self.where, f"wants to load {module}.{name}, which is neither a builtin "
                                    "container nor a numpy array, so it was refused without running it",
                                    "use the official dataset file; never load this one with plain pickle")
        return found

    def persistent_load(self, pid):
        raise UnsafePickleError(self.where, "uses persistent ids, which plain data never needs",
                                "use the official dataset file")


def load(data: bytes, where: str):
    """Unpickle ``data`` (from ``where``, for messages) allowing only containers, scalars and numpy arrays.

    Strings pickled by Python 2 come back as ``bytes`` (``encoding='bytes'``, as torchvision loads CIFAR).
    """
    try:
        return _SafeUnpickler(io.BytesIO(data), where, len(data)).load()
    except UnsafePickleError:
        raise
    except Exception as e:  # a damaged pickle fails in many ways; all of them mean the same to the user
        raise InputError(where, f"is not a readable pickle ({type(e).__name__}: {e})",
                         "the file is damaged: download it again") from e
