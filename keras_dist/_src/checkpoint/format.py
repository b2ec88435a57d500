"""The on-disk format: one directory per checkpoint, complete or invisible.

A checkpoint of global step ``S`` is the directory ``<root>/ckpt-S``::

    ckpt-S/
      arrays.npz      every array (NumPy's zip of .npy files; no pickle)
      metadata.json   versions, strategy shape, training position, RNG
                      scalars, the array index and each file's SHA-256
      COMMIT          written last: the SHA-256 of metadata.json

It is written under a temporary name (``.ckpt-S.tmp-<random>``), every file
and the directory are fsync'd, and only then renamed to ``ckpt-S`` (atomic
on POSIX) and the parent directory fsync'd. A crash at any instant leaves
either the complete new checkpoint or none, never a partial ``ckpt-S``;
on filesystems whose rename is not atomic the COMMIT marker still tells a
complete checkpoint from a partial one. Readers skip, with a warning,
directories without a valid COMMIT or whose files do not match their
recorded sizes and checksums.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import stat
import struct
import sys
import warnings
import zipfile
import zlib

import numpy as np

FORMAT_NAME = "keras_dist.checkpoint"
#: The newest format version this keras_dist reads. A job of one process
#: writes version 1 (one ``arrays.npz``); a job of several processes writes
#: version 2 (sharded: one ``shards-<rank>.npz`` per process, see
#: `keras_dist._src.checkpoint.shards`).
FORMAT_VERSION = 2
SINGLE_FILE_VERSION = 1
SHARDED_VERSION = 2
ARRAYS_FILE = "arrays.npz"
METADATA_FILE = "metadata.json"
COMMIT_FILE = "COMMIT"
PREFIX = "ckpt-"
_NAME = re.compile(r"^ckpt-(\d+)$")
_TEMP = re.compile(r"^\.ckpt-\d+\.(tmp|old|del)-[0-9a-f]+$")
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or loaded."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files are missing, truncated or do not match their
    checksums."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint's variables do not match the model's."""


# -- writing --
def write(root: str, step: int, arrays: dict, metadata: dict) -> str:
    """Writes a checkpoint atomically; returns its final path.

    Args:
        root: the directory holding checkpoints (created if needed).
        step: the global step, which names the checkpoint.
        arrays: ``{key: numpy array}`` (any keys; stored under safe names).
        metadata: JSON-serialisable dict; ``arrays`` and ``files`` entries
            are added here.

    Raises:
        CheckpointError: for an array NumPy cannot store without pickle.
    """
    step = int(step)
    os.makedirs(root, exist_ok=True)
    token = secrets.token_hex(4)
    temp = os.path.join(root, f".{PREFIX}{step}.tmp-{token}")
    final = os.path.join(root, f"{PREFIX}{step}")
    os.mkdir(temp)
    try:
        index, stored = _encode(arrays)
        arrays_path = os.path.join(temp, ARRAYS_FILE)
        with open(arrays_path, "wb") as f:
            writer = _HashingWriter(f)
            np.savez(writer, **stored)
            f.flush()
            os.fsync(f.fileno())
        metadata = dict(metadata)
        metadata.update(
            format=FORMAT_NAME,
            format_version=SINGLE_FILE_VERSION,
            arrays=index,
            files={ARRAYS_FILE: writer.digest()},
        )
        meta_bytes = json.dumps(metadata, indent=1, sort_keys=True).encode()
        _write_bytes(os.path.join(temp, METADATA_FILE), meta_bytes)
        finish(temp, final, root, token, step, meta_bytes, SINGLE_FILE_VERSION)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final


def finish(temp, final, root, token, step, meta_bytes, version) -> None:
    """Writes the COMMIT marker into `temp` and publishes it as `final`."""
    commit = {
        "format": FORMAT_NAME,
        "format_version": version,
        "step": step,
        "metadata_sha256": hashlib.sha256(meta_bytes).hexdigest(),
    }
    _write_bytes(os.path.join(temp, COMMIT_FILE), json.dumps(commit).encode())
    _fsync_dir(temp)
    _publish(temp, final, root, token)


class _HashingWriter:
    """A write-only, non-seekable file that hashes what passes through.

    Without ``seek``/``tell``, `zipfile` (under `np.savez`) streams each
    member with a trailing data descriptor instead of seeking back, so the
    SHA-256 of the file is computed while writing, not by reading it again.
    """

    def __init__(self, raw):
        self._raw = raw
        self._hash = hashlib.sha256()
        self._size = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self._hash.update(view)
        self._raw.write(view)
        self._size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()

    def read(self, *args):  # NumPy takes an object with `read` for a file
        raise OSError("write-only")

    def digest(self) -> dict:
        return {"sha256": self._hash.hexdigest(), "bytes": self._size}


def _publish(temp: str, final: str, root: str, token: str) -> None:
    """Renames `temp` to `final`, replacing an older checkpoint there."""
    old = None
    if os.path.exists(final):
        old = os.path.join(root, f".{os.path.basename(final)}.old-{token}")
        os.rename(final, old)
    os.rename(temp, final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _encode(arrays: dict):
    index, stored = [], {}
    for i, (key, value) in enumerate(arrays.items()):
        array = np.asarray(value)
        dtype = array.dtype
        if dtype.hasobject:
            raise CheckpointError(
                f"Cannot checkpoint {key!r}: arrays of Python objects "
                "would need pickle. Store numbers or strings in metadata."
            )
        if dtype.name not in DTYPES:
            raise CheckpointError(
                f"Cannot checkpoint {key!r}: its dtype {dtype} is not one "
                f"a checkpoint holds ({', '.join(sorted(DTYPES))})."
            )
        if not _is_builtin(dtype):
            # bfloat16, float8, int4 (ml_dtypes): store the raw bits.
            array = array.view(f"u{dtype.itemsize}")
        name = f"a{i}"
        stored[name] = array
        index.append(
            {
                "key": str(key),
                "name": name,
                "dtype": dtype.name,
                "shape": list(array.shape),
            }
        )
    return index, stored


def _is_builtin(dtype) -> bool:
    return dtype.kind in "biufc" and type(dtype).__module__.startswith("numpy")


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # not every platform can
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _file_digest(path: str) -> dict:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"sha256": digest.hexdigest(), "bytes": size}


# -- finding --
def step_of(path: str) -> int | None:
    """The step of a ``ckpt-<step>`` path, or None for another name."""
    match = _NAME.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def candidates(root: str) -> list[str]:
    """Paths named ``ckpt-<step>`` under `root`, newest step first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        step = step_of(name)
        if step is not None and os.path.isdir(os.path.join(root, name)):
            found.append((step, os.path.join(root, name)))
    return [path for _, path in sorted(found, reverse=True)]


# Dtypes a checkpoint may hold: NumPy's numeric ones, stored as they are,
# and the ml_dtypes types Keras uses, stored as raw unsigned bits.
_NUMPY_DTYPES = frozenset(
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 "
    "float32 float64 complex64 complex128".split()
)
_ML_DTYPES = {  # name: (kind, bytes)
    "bfloat16": ("f", 2),
    "float8_e4m3fn": ("f", 1),
    "float8_e4m3fnuz": ("f", 1),
    "float8_e4m3b11fnuz": ("f", 1),
    "float8_e5m2": ("f", 1),
    "float8_e5m2fnuz": ("f", 1),
    "int4": ("i", 1),
    "uint4": ("u", 1),
}
DTYPES = _NUMPY_DTYPES | frozenset(_ML_DTYPES)
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$")
_MEMBER_NAME = re.compile(r"^a\d{1,9}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_MAX_SMALL_FILE = 256 << 20  # metadata.json, COMMIT
_MAX_NDIM = 64
# What reading a damaged arrays file can raise (every one becomes a
# CheckpointCorruptError).
_READ_ERRORS = (
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _invalid(path: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{path} is invalid: {what}.")


def _read_small(path: str, name: str) -> bytes:
    try:
        with open(os.path.join(path, name), "rb") as f:
            data = f.read(_MAX_SMALL_FILE + 1)
    except OSError as error:
        raise CheckpointCorruptError(
            f"{path}/{name} is unreadable: {error}"
        ) from None
    if len(data) > _MAX_SMALL_FILE:
        raise _invalid(path, f"{name} is larger than {_MAX_SMALL_FILE} bytes")
    return data


def _parse_json(path: str, name: str, data: bytes) -> dict:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as error:  # JSON, UTF-8
        raise _invalid(path, f"{name} is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise _invalid(path, f"{name} is not a JSON object")
    return value


def _check_version(path: str, name: str, record: dict) -> int:
    if record.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(
            f"{path} is not a keras_dist checkpoint ({name} names format "
            f"{record.get('format')!r})."
        )
    version = record.get("format_version")
    if not _is_int(version) or version < 1:
        raise _invalid(path, f"{name} has format_version {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {version}, newer than this "
            f"keras_dist reads ({FORMAT_VERSION}); upgrade it."
        )
    return version


def read_metadata(path: str) -> dict:
    """Checks the COMMIT marker, the metadata and file sizes.

    Cheap: reads the small files and stats the arrays file (no hashing of
    the arrays; `verify` and `load_arrays` check them). Every field is
    validated (types, dtypes from `DTYPES`, file names without separators,
    the step against the directory's name) before any other file is
    touched.

    Returns:
        The metadata.

    Raises:
        CheckpointCorruptError: for a partial, damaged or invalid
            checkpoint (the message names the defect).
        CheckpointError: for a checkpoint of a newer format.
    """
    if not os.path.isfile(os.path.join(path, COMMIT_FILE)):
        raise CheckpointCorruptError(
            f"{path} has no {COMMIT_FILE} marker: it is a partial write."
        )
    for name in (COMMIT_FILE, METADATA_FILE):
        if os.path.islink(os.path.join(path, name)):
            raise _invalid(path, f"{name} is a symbolic link")
    commit = _parse_json(path, COMMIT_FILE, _read_small(path, COMMIT_FILE))
    version = _check_version(path, COMMIT_FILE, commit)
    step = commit.get("step")
    if not _is_int(step) or step < 0:
        raise _invalid(path, f"{COMMIT_FILE} has step {step!r}")
    named = step_of(path)
    if named is not None and named != step:
        raise _invalid(
            path,
            f"its name says step {named} but its {COMMIT_FILE} says {step}",
        )
    digest = commit.get("metadata_sha256")
    if not isinstance(digest, str) or not _SHA256.match(digest):
        raise _invalid(path, f"{COMMIT_FILE} has no valid metadata_sha256")
    meta_bytes = _read_small(path, METADATA_FILE)
    if hashlib.sha256(meta_bytes).hexdigest() != digest:
        raise CheckpointCorruptError(
            f"{path}/{METADATA_FILE} does not match the checksum in "
            f"{COMMIT_FILE}: the file is damaged."
        )
    metadata = _parse_json(path, METADATA_FILE, meta_bytes)
    if _check_version(path, METADATA_FILE, metadata) != version:
        raise _invalid(path, "its COMMIT and metadata versions differ")
    _check_metadata(path, metadata, step)
    for name, info in metadata["files"].items():
        file_path = os.path.join(path, name)  # `name` has no separator
        try:
            found = os.lstat(file_path)
            size = found.st_size if stat.S_ISREG(found.st_mode) else -2
        except OSError:
            size = -1
        if size == -2:
            raise _invalid(path, f"{name} is not a regular file")
        if size != info["bytes"]:
            raise CheckpointCorruptError(
                f"{file_path} has {max(size, 0)} bytes, {info['bytes']} were "
                "written: it is truncated or missing."
            )
    return metadata


def _check_metadata(path: str, metadata: dict, step: int) -> None:
    """Validates every field the reader uses (see `read_metadata`)."""
    if metadata.get("step") != step or not _is_int(metadata.get("step")):
        raise _invalid(
            path,
            f"its metadata says step {metadata.get('step')!r}, its name "
            f"and {COMMIT_FILE} say {step}",
        )
    if metadata.get("format_version") == SHARDED_VERSION:
        _check_sharded_metadata(path, metadata)
        _check_position(path, metadata, step)
        return
    files = metadata.get("files")
    if not isinstance(files, dict) or ARRAYS_FILE not in files:
        raise _invalid(path, f"its metadata lists no {ARRAYS_FILE!r} file")
    for name, info in files.items():
        if (
            not _FILE_NAME.match(name)
            or len(name) > 128
            or name in (COMMIT_FILE, METADATA_FILE)
        ):
            raise _invalid(path, f"its metadata names a file {name!r}")
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("sha256"), str)
            or not _SHA256.match(info["sha256"])
            or not _is_int(info.get("bytes"))
            or info["bytes"] < 0
        ):
            raise _invalid(path, f"its metadata entry of {name!r} is {info!r}")
    entries = metadata.get("arrays")
    if not isinstance(entries, list):
        raise _invalid(path, "its metadata has no list of arrays")
    keys, names, total = set(), set(), 0
    for entry in entries:
        if not isinstance(entry, dict):
            raise _invalid(path, f"an array entry is {entry!r}")
        key, name = entry.get("key"), entry.get("name")
        dtype, shape = entry.get("dtype"), entry.get("shape")
        if not isinstance(key, str) or not key or key in keys:
            raise _invalid(path, f"an array key is {key!r} (or repeated)")
        if not isinstance(name, str) or not _MEMBER_NAME.match(name):
            raise _invalid(path, f"array {key!r} is stored as {name!r}")
        if name in names:
            raise _invalid(path, f"two arrays are stored as {name!r}")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise _invalid(
                path,
                f"array {key!r} has dtype {dtype!r}, not one of "
                f"{', '.join(sorted(DTYPES))}",
            )
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_NDIM
            or not all(_is_int(n) and n >= 0 for n in shape)
        ):
            raise _invalid(path, f"array {key!r} has shape {shape!r}")
        keys.add(key)
        names.add(name)
        total += math.prod(shape) * _stored_dtype(dtype).itemsize
    if total > files[ARRAYS_FILE]["bytes"]:
        raise _invalid(
            path,
            f"its arrays need {total} bytes but {ARRAYS_FILE} has "
            f"{files[ARRAYS_FILE]['bytes']}",
        )
    _check_position(path, metadata, step)


def _check_position(path: str, metadata: dict, step: int) -> None:
    position = metadata.get("position", {})
    if not isinstance(position, dict):
        raise _invalid(path, f"its position is {position!r}")
    for field in ("epoch", "step_in_epoch", "global_step"):
        value = position.get(field, 0)
        if not _is_int(value) or value < 0:
            raise _invalid(path, f"its position has {field}={value!r}")
    if position.get("global_step", step) != step:
        raise _invalid(
            path,
            f"its position says global step {position['global_step']}, "
            f"its name says {step}",
        )
    per_epoch = position.get("steps_per_epoch")
    if per_epoch is not None and (not _is_int(per_epoch) or per_epoch < 1):
        raise _invalid(path, f"its position has steps_per_epoch={per_epoch!r}")
    for field in ("user", "versions", "strategy"):
        if not isinstance(metadata.get(field, {}), dict):
            raise _invalid(path, f"its metadata's {field!r} is not an object")


def _stored_dtype(name: str) -> np.dtype:
    """The dtype an array of dtype `name` (in `DTYPES`) is stored in."""
    if name in _ML_DTYPES:
        return np.dtype(f"u{_ML_DTYPES[name][1]}")
    return np.dtype(name)


def _dtype(name: str):
    if name in _ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _check_digest(path: str, expected: dict, name: str = ARRAYS_FILE) -> None:
    file_path = os.path.join(path, name)
    try:
        digest = _file_digest(file_path)
    except OSError as error:
        raise CheckpointCorruptError(
            f"{file_path} is unreadable: {error}"
        ) from None
    if digest["sha256"] != expected["sha256"]:
        raise CheckpointCorruptError(
            f"{file_path} does not match its SHA-256 checksum: the file is "
            "damaged."
        )


def _scan_member(path: str, archive, entry: dict, file=ARRAYS_FILE) -> None:
    """Checks one stored array's header against its metadata entry."""
    name = entry["name"]
    where = f"array {entry['key']!r} ({name})"
    try:
        info = archive.getinfo(name + ".npy")
    except KeyError:
        raise _invalid(path, f"{file} lacks {where}") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise _invalid(path, f"{where} is compressed (never written so)")
    with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            header = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            header = np.lib.format.read_array_header_2_0(f)
        else:
            raise _invalid(path, f"{where} has .npy version {version}")
        shape, _, dtype = header
        start = f.tell()
    expected = _stored_dtype(entry["dtype"])
    if dtype != expected:
        raise _invalid(
            path,
            f"{where} is stored as {dtype}, its metadata says "
            f"{entry['dtype']} (stored as {expected})",
        )
    if list(shape) != entry["shape"]:
        raise _invalid(
            path,
            f"{where} is stored with shape {list(shape)}, its metadata "
            f"says {entry['shape']}",
        )
    if info.file_size != start + math.prod(shape) * dtype.itemsize:
        raise _invalid(
            path,
            f"{where} holds {info.file_size - start} bytes, its shape and "
            f"dtype need {math.prod(shape) * dtype.itemsize}",
        )


def _open_arrays(path: str, metadata: dict):
    archive = zipfile.ZipFile(os.path.join(path, ARRAYS_FILE))
    wanted = {e["name"] + ".npy" for e in metadata["arrays"]}
    extra = set(archive.namelist()) - wanted
    if extra:
        archive.close()
        raise _invalid(
            path,
            f"{ARRAYS_FILE} holds arrays its metadata does not list: "
            f"{sorted(extra)[:5]}",
        )
    return archive


def verify(path: str) -> dict:
    """Checks a checkpoint as `load_arrays` does, without keeping arrays.

    The metadata, the arrays file's SHA-256, every stored array's header
    (dtype, shape, size), the zip's CRCs and the random-generator states:
    a checkpoint that passes restores (unless the model differs).

    Returns:
        The metadata.

    Raises:
        CheckpointCorruptError: naming the defect.
        CheckpointError: for a checkpoint of a newer format.
    """
    metadata = read_metadata(path)
    if metadata["format_version"] == SHARDED_VERSION:
        for name, info in metadata["files"].items():
            _check_digest(path, info, name)
        open_sharded(path, metadata).close()  # headers and random states
        return metadata
    _check_digest(path, metadata["files"][ARRAYS_FILE])
    try:
        with _open_arrays(path, metadata) as archive:
            rng = {}
            for entry in metadata["arrays"]:
                _scan_member(path, archive, entry)
                with archive.open(entry["name"] + ".npy") as f:
                    if _RNG_KEY.match(entry["key"]):
                        rng[entry["key"]] = _read_npy(f, entry)
                    else:
                        while f.read(_CHUNK):  # the CRC is checked at the end
                            pass
    except CheckpointError:
        raise
    except _READ_ERRORS as error:
        raise CheckpointCorruptError(
            f"{path}/{ARRAYS_FILE} cannot be read: {error}"
        ) from None
    check_rng(path, rng)
    return metadata


def _read_npy(f, entry):
    array = np.lib.format.read_array(f, allow_pickle=False)
    if entry["dtype"] in _ML_DTYPES:
        array = array.view(_dtype(entry["dtype"]))
    return array


def load_arrays(path: str, metadata: dict, verify: bool = True) -> dict:
    """Loads every array of the checkpoint at `path` as ``{key: array}``.

    Args:
        path: the ``ckpt-<step>`` directory.
        metadata: its metadata (from `read_metadata`).
        verify: check the arrays file's SHA-256 first.

    Raises:
        CheckpointCorruptError: on a checksum mismatch, an unreadable file
            or arrays that do not match the metadata.
    """
    if metadata["format_version"] == SHARDED_VERSION:
        if verify:
            for name, info in metadata["files"].items():
                _check_digest(path, info, name)
        arrays = open_sharded(path, metadata)
        return {k: np.asarray(v) for k, v in arrays.items()}
    if verify:
        _check_digest(path, metadata["files"][ARRAYS_FILE])
    out = {}
    try:
        with _open_arrays(path, metadata) as archive:
            for entry in metadata["arrays"]:
                _scan_member(path, archive, entry)
                with archive.open(entry["name"] + ".npy") as f:
                    out[entry["key"]] = _read_npy(f, entry)
    except CheckpointError:
        raise
    except _READ_ERRORS as error:
        raise CheckpointCorruptError(
            f"{path}/{ARRAYS_FILE} cannot be read: {error}"
        ) from None
    check_rng(path, {k: v for k, v in out.items() if _RNG_KEY.match(k)})
    return out


# The random-generator states `state.capture_rng` stores (also under a
# prefix such as ``epoch_begin/``): what their setters accept.
_RNG_KEY = re.compile(r"^(?:[A-Za-z0-9_]+/)?rng/")
_MT_STATE = ("i", (625,))  # Python's and TensorFlow's random.Random


def check_rng(path: str, arrays: dict) -> None:
    """Checks stored random-generator states before anything is set.

    Raises:
        CheckpointCorruptError: for a state its generator would refuse.
    """
    for key, array in arrays.items():
        base = key[key.index("rng/") :]
        problem = _rng_problem(base, array)
        if problem:
            raise _invalid(path, f"the random state {key!r} {problem}")


def _rng_problem(base: str, array) -> str | None:
    kind, shape = array.dtype.kind, tuple(array.shape)
    if base in ("rng/python/state", "rng/tensorflow/op_seed"):
        if kind not in "iu" or shape != (625,):
            return f"is {array.dtype}{list(shape)}, not 625 integers"
        if array[:624].min() < 0 or array[:624].max() >= 1 << 32:
            return "holds words outside 32 bits"
        if not 0 <= int(array[624]) <= 624:
            return f"has position {int(array[624])}"
    elif base == "rng/python/gauss":
        if kind != "f" or shape != (1,):
            return f"is {array.dtype}{list(shape)}, not one float"
    elif base == "rng/numpy/keys":
        if array.dtype != np.uint32 or shape != (624,):
            return f"is {array.dtype}{list(shape)}, not 624 uint32"
    elif base == "rng/numpy/extra":
        if kind != "f" or shape != (3,):
            return f"is {array.dtype}{list(shape)}, not 3 floats"
        pos, has_gauss, cached = (float(v) for v in array)
        if pos not in range(625) or has_gauss not in (0.0, 1.0):
            return f"has position {pos} and gauss flag {has_gauss}"
        if not math.isfinite(cached):
            return "has a cached gaussian that is not finite"
    elif base == "rng/torch/cpu":
        if array.dtype != np.uint8 or len(shape) != 1:
            return f"is {array.dtype}{list(shape)}, not bytes"
        if "torch" in sys.modules:
            size = int(sys.modules["torch"].get_rng_state().numel())
            if shape[0] != size:
                return f"has {shape[0]} bytes, torch's has {size}"
    elif kind not in "biuf" and array.dtype.name not in _ML_DTYPES:
        return f"has dtype {array.dtype}"
    return None


# -- sharded checkpoints (format version 2) --
#: Groups whose arrays are read lazily, part by part (`SavedArray`).
VARIABLE_GROUPS = ("model/", "optimizer/", "metrics/")


def _check_sharded_metadata(path: str, metadata: dict) -> None:
    """Validates a version-2 metadata: files, arrays and their pieces."""
    files = metadata.get("files")
    if not isinstance(files, dict) or not files:
        raise _invalid(path, "its metadata lists no shard files")
    for name, info in files.items():
        if (
            not isinstance(name, str)
            or not _FILE_NAME.match(name)
            or len(name) > 128
            or name in (COMMIT_FILE, METADATA_FILE)
        ):
            raise _invalid(path, f"its metadata names a file {name!r}")
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("sha256"), str)
            or not _SHA256.match(info["sha256"])
            or not _is_int(info.get("bytes"))
            or info["bytes"] < 0
        ):
            raise _invalid(path, f"its metadata entry of {name!r} is {info!r}")
    entries = metadata.get("arrays")
    if not isinstance(entries, list):
        raise _invalid(path, "its metadata has no list of arrays")
    keys, members, used = set(), set(), dict.fromkeys(files, 0)
    for entry in entries:
        if not isinstance(entry, dict):
            raise _invalid(path, f"an array entry is {entry!r}")
        key, dtype, shape = (
            entry.get("key"),
            entry.get("dtype"),
            entry.get("shape"),
        )
        if not isinstance(key, str) or not key or key in keys:
            raise _invalid(path, f"an array key is {key!r} (or repeated)")
        keys.add(key)
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise _invalid(path, f"array {key!r} has dtype {dtype!r}")
        if not _valid_shape(shape):
            raise _invalid(path, f"array {key!r} has shape {shape!r}")
        pieces = entry.get("pieces")
        if not isinstance(pieces, list):
            raise _invalid(path, f"array {key!r} has no list of pieces")
        covered = 0
        for piece in pieces:
            where = f"a piece of array {key!r} ({piece!r})"
            if not isinstance(piece, dict):
                raise _invalid(path, f"{where} is not an object")
            file, name = piece.get("file"), piece.get("name")
            start, size = piece.get("start"), piece.get("shape")
            if file not in files:
                raise _invalid(path, f"{where} names an unlisted file")
            if not isinstance(name, str) or not _MEMBER_NAME.match(name):
                raise _invalid(path, f"{where} has member name {name!r}")
            if (file, name) in members:
                raise _invalid(path, f"two pieces are stored as {file}/{name}")
            members.add((file, name))
            if (
                not _valid_shape(start)
                or not _valid_shape(size)
                or len(start) != len(shape)
                or len(size) != len(shape)
                or any(a + n > m for a, n, m in zip(start, size, shape))
            ):
                raise _invalid(path, f"{where} lies outside shape {shape}")
            covered += math.prod(size)
            used[file] += math.prod(size) * _stored_dtype(dtype).itemsize
        if covered != math.prod(shape) or not pieces_disjoint(pieces):
            raise _invalid(
                path,
                f"the pieces of array {key!r} hold {covered} of its "
                f"{math.prod(shape)} elements (or overlap)",
            )
    for name, total in used.items():
        if total > files[name]["bytes"]:
            raise _invalid(
                path,
                f"its pieces in {name} need {total} bytes but the file has "
                f"{files[name]['bytes']}",
            )


def pieces_disjoint(pieces: list) -> bool:
    """Whether no two pieces (``{"start", "shape"}``) overlap: with their
    total size equal to the array's, they then cover it exactly once."""
    boxes = sorted(
        (tuple(p["start"]), tuple(p["shape"]))
        for p in pieces
        if math.prod(p["shape"])
    )
    for i, (start, size) in enumerate(boxes):
        for other, other_size in boxes[i + 1 :]:
            if other[0] >= start[0] + size[0]:
                break  # sorted by the first offset: no later one overlaps
            if all(
                a < b + m and b < a + n
                for a, n, b, m in zip(start, size, other, other_size)
            ):
                return False
    return True


def _valid_shape(shape) -> bool:
    return (
        isinstance(shape, list)
        and len(shape) <= _MAX_NDIM
        and all(_is_int(n) and n >= 0 for n in shape)
    )


def bounds(index, shape) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of a region given as a tuple of slices
    (None or missing: the whole dimension) of an array of `shape`."""
    index = tuple(index or ())
    out = []
    for axis, size in enumerate(shape):
        part = index[axis] if axis < len(index) else slice(None)
        start, stop, step = part.indices(size)
        if step != 1:
            raise ValueError(f"A checkpoint region has step {step}.")
        out.append((start, max(start, stop)))
    return out


class SavedArray:
    """An array of a sharded checkpoint, read region by region.

    Attributes:
        key: its checkpoint key (``model/dense/kernel``).
        shape: its global shape.
        dtype: its NumPy dtype.
        layout: the layout it was saved under (as the metadata records it).
    """

    def __init__(self, source, entry):
        self._source = source
        self.key = entry["key"]
        self.shape = tuple(entry["shape"])
        self.dtype = _dtype(entry["dtype"])
        self.layout = entry.get("layout")
        self._entry = entry

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def read(self, index=None) -> np.ndarray:
        """The region `index` (a tuple of slices; None: all) as an array,
        assembled from the pieces it overlaps (only those are read).

        Raises:
            CheckpointCorruptError: if the pieces do not cover the region.
        """
        region = bounds(index, self.shape)
        out = np.empty([b - a for a, b in region], self.dtype)
        filled = 0
        for piece in self._entry["pieces"]:
            lows, highs = [], []
            for (a, b), p, n in zip(region, piece["start"], piece["shape"]):
                lows.append(max(a, p))
                highs.append(min(b, p + n))
            if any(lo >= hi for lo, hi in zip(lows, highs)):
                continue
            data = self._source.piece(self._entry, piece)
            target = tuple(
                slice(lo - a, hi - a)
                for lo, hi, (a, _) in zip(lows, highs, region)
            )
            origin = tuple(
                slice(lo - p, hi - p)
                for lo, hi, p in zip(lows, highs, piece["start"])
            )
            out[target] = data[origin]
            filled += math.prod(hi - lo for lo, hi in zip(lows, highs))
        if filled != out.size:
            raise CheckpointCorruptError(
                f"{self._source.path}: the pieces of {self.key!r} cover "
                f"{filled} of the {out.size} elements of region {region}."
            )
        return out

    def __array__(self, dtype=None, copy=None):
        array = self.read()
        return array if dtype is None else array.astype(dtype)

    def __repr__(self):
        return (
            f"SavedArray({self.key!r}, shape={self.shape}, dtype={self.dtype}, "
            f"pieces={len(self._entry['pieces'])})"
        )


class _ShardFiles:
    """The open shard files of one sharded checkpoint."""

    def __init__(self, path: str):
        self.path = path
        self._archives = {}

    def archive(self, name: str):
        archive = self._archives.get(name)
        if archive is None:
            try:
                archive = zipfile.ZipFile(os.path.join(self.path, name))
            except _READ_ERRORS as error:
                raise CheckpointCorruptError(
                    f"{self.path}/{name} cannot be read: {error}"
                ) from None
            self._archives[name] = archive
        return archive

    def piece(self, entry: dict, piece: dict) -> np.ndarray:
        member = dict(
            key=entry["key"],
            name=piece["name"],
            dtype=entry["dtype"],
            shape=piece["shape"],
        )
        try:
            with self.archive(piece["file"]).open(piece["name"] + ".npy") as f:
                return _read_npy(f, member)
        except CheckpointError:
            raise
        except _READ_ERRORS as error:
            raise CheckpointCorruptError(
                f"{self.path}/{piece['file']} cannot be read: {error}"
            ) from None

    def close(self) -> None:
        for archive in self._archives.values():
            archive.close()
        self._archives = {}


class ShardedArrays(dict):
    """``{key: array}`` of a sharded checkpoint: the variables' arrays are
    `SavedArray` objects (read part by part: each process reads only the
    regions it holds), every other array (random states, extras) a NumPy
    array."""

    def __init__(self, files: _ShardFiles):
        super().__init__()
        self.files = files

    def close(self) -> None:
        """Closes the open files (reading again reopens them)."""
        self.files.close()


def open_sharded(path: str, metadata: dict) -> ShardedArrays:
    """Opens a sharded (version 2) checkpoint for reading.

    Checks that every file holds exactly the members its metadata lists
    and every piece's header (dtype, shape, size), and reads the arrays
    outside the variable groups (random states, extras), which are
    checked as `load_arrays` checks them.

    Returns:
        A `ShardedArrays` mapping.

    Raises:
        CheckpointCorruptError: naming the defect.
    """
    files = _ShardFiles(path)
    out = ShardedArrays(files)
    wanted = {name: set() for name in metadata["files"]}
    for entry in metadata["arrays"]:
        for piece in entry["pieces"]:
            wanted[piece["file"]].add(piece["name"] + ".npy")
    try:
        for name, members in wanted.items():
            extra = set(files.archive(name).namelist()) - members
            if extra:
                raise _invalid(
                    path,
                    f"{name} holds arrays its metadata does not list: "
                    f"{sorted(extra)[:5]}",
                )
        for entry in metadata["arrays"]:
            for piece in entry["pieces"]:
                member = dict(
                    key=entry["key"],
                    name=piece["name"],
                    dtype=entry["dtype"],
                    shape=piece["shape"],
                )
                _scan_member(
                    path, files.archive(piece["file"]), member, piece["file"]
                )
            array = SavedArray(files, entry)
            if entry["key"].startswith(VARIABLE_GROUPS):
                out[entry["key"]] = array
            else:
                out[entry["key"]] = array.read()
    except CheckpointError:
        files.close()
        raise
    except _READ_ERRORS as error:
        files.close()
        raise CheckpointCorruptError(
            f"{path} cannot be read: {error}"
        ) from None
    check_rng(path, {k: v for k, v in out.items() if _RNG_KEY.match(k)})
    return out


def latest(root: str, warn: bool = True) -> str | None:
    """The newest complete checkpoint under `root`, or None.

    Checks each candidate as `restore` does (`verify`): partial, damaged
    or invalid ones are skipped, with one warning each naming the defect
    (as are leftovers of interrupted writes).
    """
    if warn:
        for name in partial_writes(root):
            warnings.warn(
                f"Ignoring {os.path.join(root, name)}: an interrupted "
                "(partial) checkpoint write.",
                stacklevel=3,
            )
    for path in candidates(root):
        try:
            verify(path)
        except CheckpointError as error:
            if warn:
                warnings.warn(
                    f"Skipping checkpoint {path}: {error}", stacklevel=3
                )
            continue
        return path
    return None


# -- removing --
def remove(path: str) -> None:
    """Removes a checkpoint so that no crash leaves it half-visible.

    The COMMIT marker goes first (the checkpoint is then invalid), then the
    directory is renamed away and deleted.
    """
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(path, COMMIT_FILE))
    root, name = os.path.split(os.path.normpath(path))
    doomed = os.path.join(root, f".{name}.del-{secrets.token_hex(4)}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def keep_last(root: str, keep: int) -> list[str]:
    """Removes all but the `keep` newest complete checkpoints under `root`.

    Returns:
        The removed paths.
    """
    valid = []
    for path in candidates(root):
        try:
            read_metadata(path)
        except CheckpointError:
            continue
        valid.append(path)
    removed = valid[max(int(keep), 1) :]
    for path in removed:
        remove(path)
    return removed


def partial_writes(root: str) -> list[str]:
    """Names of interrupted writes under `root` (``.ckpt-S.tmp-*``)."""
    if not os.path.isdir(root):
        return []
    return sorted(
        n for n in os.listdir(root) if _TEMP.match(n) and ".tmp-" in n
    )


def clean_temporaries(root: str) -> None:
    """Deletes leftovers of interrupted writes (``.ckpt-*.tmp-*`` etc.).

    Call only where no save into `root` is in flight.
    """
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if _TEMP.match(name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
