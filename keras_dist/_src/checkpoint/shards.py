"""Sharded checkpoints: every process writes what it owns, the chief commits.

A job of several processes writes format version 2::

    ckpt-S/
      shards-00000.npz   the pieces process 0 owns (NumPy's zip, no pickle)
      shards-00001.npz   the pieces process 1 owns
      ...
      metadata.json      written by the chief: for every array its key,
                         dtype, global shape, the layout it was saved under
                         and its pieces (file, member, start offsets,
                         shape); every file's size and SHA-256
      COMMIT             written last, by the chief

No process gathers another's values: each exports its own pieces
(`export_state` of its backend: a shard it holds, or a whole value on the
chief) into ``shards-<rank>.npz`` of the temporary directory
``.ckpt-S.tmp-<token>`` (created by the chief, its name broadcast), then
writes ``shards-<rank>.json`` (its index and the file's checksum) by an
atomic rename. The chief waits until every process's index is there,
checks that the pieces cover every array exactly once, writes the metadata
and the COMMIT marker and renames the directory to ``ckpt-S`` (as
`format.write` does): complete or invisible. Restore reads, on each
process, only the regions its own variables hold (`import_state`),
whatever layout, strategy, process count or backend wrote them
(`keras_dist._src.checkpoint.reading`).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import time

import numpy as np

from keras_dist._src.checkpoint import format as fmt
from keras_dist._src.checkpoint import reading


def shard_file(rank: int) -> str:
    """The name of process `rank`'s shard file."""
    return f"shards-{int(rank):05d}.npz"


def _index_file(rank: int) -> str:
    return f"shards-{int(rank):05d}.json"


def _error_file(rank: int) -> str:
    return f"shards-{int(rank):05d}.error"


def temp_path(root: str, step: int, token: str) -> str:
    """The temporary directory of checkpoint `step` being written."""
    return os.path.join(root, f".{fmt.PREFIX}{int(step)}.tmp-{token}")


def begin(root: str, step: int) -> str:
    """Creates the temporary directory of a sharded write (chief).

    Returns:
        Its token (every process derives the path with `temp_path`).
    """
    os.makedirs(root, exist_ok=True)
    fmt.check_replaceable(os.path.join(root, f"{fmt.PREFIX}{int(step)}"))
    token = secrets.token_hex(4)
    os.mkdir(temp_path(root, step, token))
    return token


def write_own(temp: str, rank: int, entries: list) -> dict:
    """Writes this process's pieces and index into `temp`.

    Args:
        temp: the temporary checkpoint directory.
        rank: this process's rank.
        entries: ``[{"key", "shape", "dtype", "layout", "pieces":
            [(start, array), ...]}, ...]``, one per array (with no pieces
            where another process writes it).

    Returns:
        The index record written.

    Raises:
        CheckpointError: for an array NumPy cannot store without pickle.
    """
    if not os.path.isdir(temp):
        raise fmt.CheckpointError(
            f"Process {rank} cannot see the checkpoint directory {temp!r} "
            "that the chief created: with several processes the checkpoint "
            "directory must be on a filesystem every process sees (NFS, "
            "Lustre, a shared volume). Point it there."
        )
    arrays, owners = {}, []
    for entry in entries:
        for start, array in entry["pieces"]:
            arrays[f"{entry['key']}@{len(arrays)}"] = array
            owners.append((entry["key"], tuple(int(a) for a in start)))
    index, stored = fmt.encode(arrays)
    pieces = {}
    for (key, start), item in zip(owners, index):
        pieces.setdefault(key, []).append(
            {
                "file": shard_file(rank),
                "name": item["name"],
                "start": list(start),
                "shape": item["shape"],
                "dtype": item["dtype"],
            }
        )
    with open(os.path.join(temp, shard_file(rank)), "wb") as f:
        writer = fmt.HashingWriter(f)
        np.savez(writer, **stored)
        f.flush()
        os.fsync(f.fileno())
    record = {
        "rank": int(rank),
        "file": shard_file(rank),
        "digest": writer.digest(),
        "arrays": [
            {
                "key": str(entry["key"]),
                "shape": [int(n) for n in entry["shape"]],
                "dtype": entry.get("dtype"),
                "layout": entry.get("layout"),
                "pieces": pieces.get(entry["key"], []),
            }
            for entry in entries
        ],
    }
    _publish_small(temp, _index_file(rank), json.dumps(record).encode())
    return record


def write_failure(temp: str, rank: int, message: str) -> None:
    """Tells the chief that process `rank` could not write its pieces."""
    try:
        _publish_small(temp, _error_file(rank), message.encode())
    except OSError:
        pass  # the chief then times out, naming this process


def _publish_small(temp: str, name: str, data: bytes) -> None:
    part = os.path.join(temp, name + ".part")
    fmt.write_bytes(part, data)
    os.replace(part, os.path.join(temp, name))


def commit(
    root: str,
    step: int,
    token: str,
    world_size: int,
    metadata: dict,
    timeout: float = 1800.0,
) -> str:
    """Waits for every process's pieces, then commits the checkpoint (chief).

    Returns:
        The final ``ckpt-<step>`` path.

    Raises:
        CheckpointError: when a process failed or did not write within
            `timeout` seconds, or the pieces do not cover every array
            exactly once; the temporary directory is removed.
    """
    step = int(step)
    temp = temp_path(root, step, token)
    final = os.path.join(root, f"{fmt.PREFIX}{step}")
    try:
        records = _wait_for_records(temp, world_size, timeout)
        merged = _merge(records)
        for rank in range(world_size):
            os.remove(os.path.join(temp, _index_file(rank)))
        metadata = dict(metadata)
        metadata.update(
            format=fmt.FORMAT_NAME,
            format_version=fmt.SHARDED_VERSION,
            processes=int(world_size),
            arrays=merged,
            files={r["file"]: r["digest"] for r in records},
        )
        meta_bytes = json.dumps(metadata, indent=1, sort_keys=True).encode()
        fmt.write_bytes(os.path.join(temp, fmt.METADATA_FILE), meta_bytes)
        fmt.finish(
            temp, final, root, token, step, meta_bytes, fmt.SHARDED_VERSION
        )
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final


def abort(root: str, step: int, token: str) -> None:
    """Removes a sharded write's temporary directory (chief)."""
    shutil.rmtree(temp_path(root, step, token), ignore_errors=True)


def _wait_for_records(temp: str, world_size: int, timeout: float) -> list:
    deadline = time.monotonic() + float(timeout)
    pending = set(range(int(world_size)))
    records = {}
    while pending:
        for rank in sorted(pending):
            failed = os.path.join(temp, _error_file(rank))
            if os.path.exists(failed):
                with open(failed, encoding="utf-8", errors="replace") as f:
                    message = f.read()
                raise fmt.CheckpointError(
                    f"Process {rank} could not write its part of the "
                    f"checkpoint: {message}"
                )
            path = os.path.join(temp, _index_file(rank))
            if os.path.exists(path):
                with open(path, "rb") as f:
                    records[rank] = json.loads(f.read())
                pending.discard(rank)
        if pending:
            if time.monotonic() > deadline:
                raise fmt.CheckpointError(
                    f"Processes {sorted(pending)} did not write their part "
                    f"of the checkpoint within {timeout:.0f} s (into "
                    f"{temp}): is the directory on a filesystem every "
                    "process shares?"
                )
            time.sleep(0.02)
    return [records[rank] for rank in range(int(world_size))]


def _merge(records: list) -> list:
    """One metadata entry per array, its pieces from every process."""
    merged, order = {}, []
    for record in records:
        for entry in record["arrays"]:
            key = entry["key"]
            found = merged.get(key)
            if found is None:
                found = merged[key] = {
                    "key": key,
                    "shape": entry["shape"],
                    "dtype": None,
                    "layout": entry.get("layout"),
                    "pieces": [],
                }
                order.append(key)
            if found["shape"] != entry["shape"]:
                raise fmt.CheckpointError(
                    f"The processes disagree on the shape of {key!r}: "
                    f"{found['shape']} and {entry['shape']} (process "
                    f"{record['rank']})."
                )
            for piece in entry["pieces"]:
                dtype = piece.pop("dtype")
                if found["dtype"] is None:
                    found["dtype"] = dtype
                elif found["dtype"] != dtype:
                    raise fmt.CheckpointError(
                        f"The pieces of {key!r} have dtypes "
                        f"{found['dtype']} and {dtype} (process "
                        f"{record['rank']})."
                    )
                found["pieces"].append(piece)
            if found["layout"] is None:
                found["layout"] = entry.get("layout")
    out = []
    for key in order:
        entry = merged[key]
        covered = sum(math.prod(p["shape"]) for p in entry["pieces"])
        if (
            covered != math.prod(entry["shape"])
            or entry["dtype"] is None
            or not reading.pieces_disjoint(entry["pieces"])
        ):
            raise fmt.CheckpointError(
                f"The processes' pieces of {key!r} hold {covered} of its "
                f"{math.prod(entry['shape'])} elements: they disagree on "
                "which process writes which shard."
            )
        if entry["layout"] is None:
            del entry["layout"]
        out.append(entry)
    return out
