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
import os
import re
import secrets
import shutil
import warnings

import numpy as np

FORMAT_NAME = "keras_dist.checkpoint"
FORMAT_VERSION = 1
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
            format_version=FORMAT_VERSION,
            arrays=index,
            files={ARRAYS_FILE: writer.digest()},
        )
        meta_bytes = json.dumps(metadata, indent=1, sort_keys=True).encode()
        _write_bytes(os.path.join(temp, METADATA_FILE), meta_bytes)
        commit = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "step": step,
            "metadata_sha256": hashlib.sha256(meta_bytes).hexdigest(),
        }
        _write_bytes(
            os.path.join(temp, COMMIT_FILE), json.dumps(commit).encode()
        )
        _fsync_dir(temp)
        _publish(temp, final, root, token)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final


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


def read_metadata(path: str) -> dict:
    """Checks the COMMIT marker and file sizes; returns the metadata.

    Cheap: reads the small files and stats the arrays file (no hashing of
    the arrays; `load_arrays` verifies their checksum).

    Raises:
        CheckpointCorruptError: for a partial or damaged checkpoint.
    """
    commit_path = os.path.join(path, COMMIT_FILE)
    if not os.path.exists(commit_path):
        raise CheckpointCorruptError(
            f"{path} has no {COMMIT_FILE} marker: it is a partial write."
        )
    try:
        with open(commit_path, "rb") as f:
            commit = json.loads(f.read())
        with open(os.path.join(path, METADATA_FILE), "rb") as f:
            meta_bytes = f.read()
    except (OSError, ValueError) as error:
        raise CheckpointCorruptError(f"{path} is unreadable: {error}") from None
    if hashlib.sha256(meta_bytes).hexdigest() != commit.get("metadata_sha256"):
        raise CheckpointCorruptError(
            f"{path}/{METADATA_FILE} does not match the checksum in "
            f"{COMMIT_FILE}: the file is damaged."
        )
    metadata = json.loads(meta_bytes)
    if metadata.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{path} is not a keras_dist checkpoint.")
    if int(metadata.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {metadata['format_version']}, newer "
            f"than this keras_dist reads ({FORMAT_VERSION}); upgrade it."
        )
    for name, info in metadata["files"].items():
        file_path = os.path.join(path, name)
        size = os.path.getsize(file_path) if os.path.exists(file_path) else -1
        if size != info["bytes"]:
            raise CheckpointCorruptError(
                f"{file_path} has {max(size, 0)} bytes, {info['bytes']} were "
                "written: it is truncated or missing."
            )
    return metadata


def load_arrays(path: str, metadata: dict, verify: bool = True) -> dict:
    """Loads every array of the checkpoint at `path` as ``{key: array}``.

    Args:
        path: the ``ckpt-<step>`` directory.
        metadata: its metadata (from `read_metadata`).
        verify: check the arrays file's SHA-256 first.

    Raises:
        CheckpointCorruptError: on a checksum mismatch or unreadable file.
    """
    file_path = os.path.join(path, ARRAYS_FILE)
    expected = metadata["files"][ARRAYS_FILE]
    if verify and _file_digest(file_path)["sha256"] != expected["sha256"]:
        raise CheckpointCorruptError(
            f"{file_path} does not match its SHA-256 checksum: the file is "
            "damaged."
        )
    out = {}
    try:
        with np.load(file_path, allow_pickle=False) as stored:
            for entry in metadata["arrays"]:
                array = stored[entry["name"]]
                dtype = _dtype(entry["dtype"])
                if array.dtype != dtype:
                    array = array.view(dtype)
                out[entry["key"]] = array
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointCorruptError(
            f"{file_path} cannot be read: {error}"
        ) from None
    return out


def _dtype(name: str):
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def latest(root: str, warn: bool = True) -> str | None:
    """The newest complete checkpoint under `root`, or None.

    Partial or damaged ones are skipped, with a warning naming them (as
    are leftovers of interrupted writes).
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
            read_metadata(path)
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
