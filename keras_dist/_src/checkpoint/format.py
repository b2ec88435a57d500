"""The on-disk format: one directory per checkpoint, complete or invisible.

A checkpoint of global step ``S`` is the directory ``<root>/ckpt-S``::

    ckpt-S/
      arrays.npz      every array (NumPy's zip of .npy files; no pickle)
      metadata.json   versions, strategy shape, training position, RNG
                      scalars, the array index and each file's SHA-256
      COMMIT          written last: the SHA-256 of metadata.json

(that is version 1, written by a job of one process holding every value
whole; version 2, sharded, holds one ``shards-<rank>.npz`` per process
instead of ``arrays.npz``: see `keras_dist._src.checkpoint.shards`, which
writes it, and `keras_dist._src.checkpoint.reading`, which reads the arrays
of both).

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
import stat
import warnings

import numpy as np

from keras_dist._src.checkpoint.base import (  # noqa: F401 (the format's names)
    ARRAYS_FILE,
    COMMIT_FILE,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    PREFIX,
    SHA256,
    SHARDED_VERSION,
    SINGLE_FILE_VERSION,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    fsync_dir,
    invalid,
    is_int,
    write_bytes,
)
from keras_dist._src.checkpoint.reading import (  # noqa: F401
    SavedArray,
    SavedArrays,
    check_arrays,
    check_digests,
    open_arrays,
)

_NAME = re.compile(r"^ckpt-(\d+)$")
#: Names of interrupted writes, replaced and removed checkpoints.
TEMP_NAME = re.compile(r"^\.ckpt-\d+\.(tmp|old|del)-[0-9a-f]{8}$")
# What a checkpoint directory (or an interrupted write of one) may hold.
_CHECKPOINT_MEMBER = re.compile(
    r"^(arrays\.npz|metadata\.json|COMMIT"
    r"|shards-\d{5}\.(npz|json|error))(\.part)?$"
)
_MAX_SMALL_FILE = 256 << 20  # metadata.json, COMMIT


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
    check_replaceable(final)  # before writing anything
    os.mkdir(temp)
    try:
        index, stored = encode(arrays)
        arrays_path = os.path.join(temp, ARRAYS_FILE)
        with open(arrays_path, "wb") as f:
            writer = HashingWriter(f)
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
        write_bytes(os.path.join(temp, METADATA_FILE), meta_bytes)
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
    write_bytes(os.path.join(temp, COMMIT_FILE), json.dumps(commit).encode())
    fsync_dir(temp)
    _publish(temp, final, root, token)


class HashingWriter:
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


def check_replaceable(final: str) -> None:
    """Raises unless `final` is free or holds a keras_dist checkpoint
    (complete, or one whose removal was interrupted): a save replaces only
    what keras_dist wrote.

    Raises:
        CheckpointError: naming what is there and what to do.
    """
    if not os.path.lexists(final):
        return
    if os.path.isdir(final) and not os.path.islink(final):
        for name in (COMMIT_FILE, METADATA_FILE):
            try:
                record = json.loads(_read_small(final, name))
            except (CheckpointError, OSError, ValueError):
                continue
            if isinstance(record, dict) and record.get("format") == FORMAT_NAME:
                return
        held = sorted(os.listdir(final))
        what = (
            f"a directory holding {held[:5]}" if held else "an empty directory"
        )
    else:
        what = "a file or link"
    raise CheckpointError(
        f"{final} exists and is {what}, not a keras_dist checkpoint: "
        "keras_dist replaces only checkpoints it wrote. Move it away, or "
        "save into another directory or under another step."
    )


def _publish(temp: str, final: str, root: str, token: str) -> None:
    """Renames `temp` to `final`, replacing an older checkpoint there."""
    check_replaceable(final)
    old = None
    if os.path.exists(final):
        old = os.path.join(root, f".{os.path.basename(final)}.old-{token}")
        os.rename(final, old)
    os.rename(temp, final)
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def encode(arrays: dict):
    """The index entries (key, member name, dtype, shape) and the members
    to store of ``{key: array}``; ml_dtypes' arrays as their raw bits.

    Raises:
        CheckpointError: for an array NumPy cannot store without pickle.
    """
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


def _read_small(path: str, name: str) -> bytes:
    try:
        with open(os.path.join(path, name), "rb") as f:
            data = f.read(_MAX_SMALL_FILE + 1)
    except OSError as error:
        raise CheckpointCorruptError(
            f"{path}/{name} is unreadable: {error}"
        ) from None
    if len(data) > _MAX_SMALL_FILE:
        raise invalid(path, f"{name} is larger than {_MAX_SMALL_FILE} bytes")
    return data


def _parse_json(path: str, name: str, data: bytes) -> dict:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as error:  # JSON, UTF-8
        raise invalid(path, f"{name} is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise invalid(path, f"{name} is not a JSON object")
    return value


def _check_version(path: str, name: str, record: dict) -> int:
    if record.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(
            f"{path} is not a keras_dist checkpoint ({name} names format "
            f"{record.get('format')!r})."
        )
    version = record.get("format_version")
    if not is_int(version) or version < 1:
        raise invalid(path, f"{name} has format_version {version!r}")
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
            raise invalid(path, f"{name} is a symbolic link")
    commit = _parse_json(path, COMMIT_FILE, _read_small(path, COMMIT_FILE))
    version = _check_version(path, COMMIT_FILE, commit)
    step = commit.get("step")
    if not is_int(step) or step < 0:
        raise invalid(path, f"{COMMIT_FILE} has step {step!r}")
    named = step_of(path)
    if named is not None and named != step:
        raise invalid(
            path,
            f"its name says step {named} but its {COMMIT_FILE} says {step}",
        )
    digest = commit.get("metadata_sha256")
    if not isinstance(digest, str) or not SHA256.match(digest):
        raise invalid(path, f"{COMMIT_FILE} has no valid metadata_sha256")
    meta_bytes = _read_small(path, METADATA_FILE)
    if hashlib.sha256(meta_bytes).hexdigest() != digest:
        raise CheckpointCorruptError(
            f"{path}/{METADATA_FILE} does not match the checksum in "
            f"{COMMIT_FILE}: the file is damaged."
        )
    metadata = _parse_json(path, METADATA_FILE, meta_bytes)
    if _check_version(path, METADATA_FILE, metadata) != version:
        raise invalid(path, "its COMMIT and metadata versions differ")
    _check_metadata(path, metadata, step)
    for name, info in metadata["files"].items():
        file_path = os.path.join(path, name)  # `name` has no separator
        try:
            found = os.lstat(file_path)
            size = found.st_size if stat.S_ISREG(found.st_mode) else -2
        except OSError:
            size = -1
        if size == -2:
            raise invalid(path, f"{name} is not a regular file")
        if size != info["bytes"]:
            raise CheckpointCorruptError(
                f"{file_path} has {max(size, 0)} bytes, {info['bytes']} were "
                "written: it is truncated or missing."
            )
    return metadata


def _check_metadata(path: str, metadata: dict, step: int) -> None:
    """Validates every field the reader uses (see `read_metadata`)."""
    if metadata.get("step") != step or not is_int(metadata.get("step")):
        raise invalid(
            path,
            f"its metadata says step {metadata.get('step')!r}, its name "
            f"and {COMMIT_FILE} say {step}",
        )
    check_arrays(path, metadata)
    _check_position(path, metadata, step)


def _check_position(path: str, metadata: dict, step: int) -> None:
    position = metadata.get("position", {})
    if not isinstance(position, dict):
        raise invalid(path, f"its position is {position!r}")
    for field in ("epoch", "step_in_epoch", "global_step"):
        value = position.get(field, 0)
        if not is_int(value) or value < 0:
            raise invalid(path, f"its position has {field}={value!r}")
    if position.get("global_step", step) != step:
        raise invalid(
            path,
            f"its position says global step {position['global_step']}, "
            f"its name says {step}",
        )
    per_epoch = position.get("steps_per_epoch")
    if per_epoch is not None and (not is_int(per_epoch) or per_epoch < 1):
        raise invalid(path, f"its position has steps_per_epoch={per_epoch!r}")
    for field in ("user", "versions", "strategy"):
        if not isinstance(metadata.get(field, {}), dict):
            raise invalid(path, f"its metadata's {field!r} is not an object")


def verify(path: str) -> dict:
    """Checks a checkpoint as `load_arrays` does, without keeping arrays.

    The metadata, the array files' SHA-256, every stored array's header
    (dtype, shape, size) and the random-generator states; of version 1
    also the zip's CRCs: a checkpoint that passes restores (unless the
    model differs).

    Returns:
        The metadata.

    Raises:
        CheckpointCorruptError: naming the defect.
        CheckpointError: for a checkpoint of a newer format.
    """
    metadata = read_metadata(path)
    check_digests(path, metadata)
    single = metadata["format_version"] == SINGLE_FILE_VERSION
    open_arrays(path, metadata, check_data=single).close()
    return metadata


def load_arrays(path: str, metadata: dict, verify: bool = True) -> dict:
    """Loads every array of the checkpoint at `path` as ``{key: array}``.

    Args:
        path: the ``ckpt-<step>`` directory.
        metadata: its metadata (from `read_metadata`).
        verify: check the array files' SHA-256 first.

    Raises:
        CheckpointCorruptError: on a checksum mismatch, an unreadable file
            or arrays that do not match the metadata.
    """
    if verify:
        check_digests(path, metadata)
    arrays = open_arrays(path, metadata)
    try:
        return {key: np.asarray(value) for key, value in arrays.items()}
    finally:
        arrays.close()


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
        n for n in os.listdir(root) if TEMP_NAME.match(n) and ".tmp-" in n
    )


def clean_temporaries(root: str) -> None:
    """Deletes leftovers of interrupted writes (``.ckpt-*.tmp-*`` etc.).

    Call only where no save into `root` is in flight.
    """
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if TEMP_NAME.match(name) and _holds_only_checkpoint_files(path):
            shutil.rmtree(path, ignore_errors=True)


def _holds_only_checkpoint_files(path: str) -> bool:
    """Whether `path` is a directory (not a link) whose entries are all
    names keras_dist writes into a checkpoint: a user's directory that
    happens to carry a temporary's name is left alone."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return all(_CHECKPOINT_MEMBER.match(n) for n in names)
