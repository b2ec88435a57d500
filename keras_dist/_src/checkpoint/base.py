"""What every part of the on-disk format shares: names, errors, dtypes.

The file names and format versions, the errors a reader or writer raises,
the dtypes a checkpoint holds (and how each is stored), and the small
checks and file helpers that `format` (one checkpoint directory),
`reading` (the arrays of either version) and `shards` (sharded writes) all
use. It imports nothing else of keras_dist.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import struct
import zipfile
import zlib

import numpy as np

FORMAT_NAME = "keras_dist.checkpoint"
#: The newest format version this keras_dist reads. A job of one process
#: writes version 1 (one ``arrays.npz``); a job of several processes (or
#: variables split over devices) writes version 2 (sharded: one
#: ``shards-<rank>.npz`` per process, see `keras_dist._src.checkpoint.shards`).
FORMAT_VERSION = 2
SINGLE_FILE_VERSION = 1
SHARDED_VERSION = 2
ARRAYS_FILE = "arrays.npz"
METADATA_FILE = "metadata.json"
COMMIT_FILE = "COMMIT"
PREFIX = "ckpt-"
CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or loaded."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files are missing, truncated or do not match their
    checksums."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint's variables do not match the model's."""


# Dtypes a checkpoint may hold: NumPy's numeric ones, stored as they are,
# and the ml_dtypes types Keras uses, stored as raw unsigned bits.
_NUMPY_DTYPES = frozenset(
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 "
    "float32 float64 complex64 complex128".split()
)
ML_DTYPES = {  # name: (kind, bytes)
    "bfloat16": ("f", 2),
    "float8_e4m3fn": ("f", 1),
    "float8_e4m3fnuz": ("f", 1),
    "float8_e4m3b11fnuz": ("f", 1),
    "float8_e5m2": ("f", 1),
    "float8_e5m2fnuz": ("f", 1),
    "int4": ("i", 1),
    "uint4": ("u", 1),
}
DTYPES = _NUMPY_DTYPES | frozenset(ML_DTYPES)
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$")
MEMBER_NAME = re.compile(r"^a\d{1,9}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_NDIM = 64
# What reading a damaged arrays file can raise (every one becomes a
# CheckpointCorruptError).
READ_ERRORS = (
    OSError,
    ValueError,
    KeyError,
    EOFError,
    TypeError,
    OverflowError,
    NotImplementedError,
    zipfile.BadZipFile,
    zlib.error,
    struct.error,
)


def stored_dtype(name: str) -> np.dtype:
    """The dtype an array of dtype `name` (in `DTYPES`) is stored in."""
    if name in ML_DTYPES:
        return np.dtype(f"u{ML_DTYPES[name][1]}")
    return np.dtype(name)


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype named `name` (in `DTYPES`; ml_dtypes' included)."""
    if name in ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def is_int(value) -> bool:
    """Whether `value` is an int (and not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def valid_shape(shape) -> bool:
    """Whether `shape` is a JSON list of non-negative ints of a sane rank."""
    return (
        isinstance(shape, list)
        and len(shape) <= MAX_NDIM
        and all(is_int(n) and n >= 0 for n in shape)
    )


def invalid(path: str, what: str) -> CheckpointCorruptError:
    """The error of a checkpoint at `path` whose `what` is wrong."""
    return CheckpointCorruptError(f"{path} is invalid: {what}.")


def write_bytes(path: str, data: bytes) -> None:
    """Writes `data` to `path` and fsyncs it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    """Fsyncs the directory `path` (where the platform can)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def file_digest(path: str) -> dict:
    """``{"sha256", "bytes"}`` of the file at `path`."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"sha256": digest.hexdigest(), "bytes": size}
