"""The chief's values on every JAX process: which parts of which
variables differ between processes (fingerprints compared in one small
collective), and the chief's copy of a value, through
`jax.experimental.multihost_utils`."""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from jax.experimental import multihost_utils


def fingerprints(variables) -> np.ndarray:
    """``[variable, slot, (where, what)]``: for each part of each variable
    this process holds (one slot per local device at most, in device
    order), a 64-bit hash of the part's place in the whole value and one
    of its bytes; zeros in an unused slot."""
    slots = len(jax.local_devices())
    out = np.zeros((len(variables), slots, 2), np.uint64)
    for i, variable in enumerate(variables):
        value = variable.value
        if isinstance(value, jax.Array):
            parts = [
                (tuple((s.start, s.stop) for s in shard.index), shard.data)
                for shard in sorted(
                    value.addressable_shards, key=lambda s: s.device.id
                )
            ]
        else:
            parts = [("whole", value)]
        for j, (where, data) in enumerate(parts[:slots]):
            data = np.ascontiguousarray(np.asarray(data)).reshape(-1)
            out[i, j, 0] = _hash64(repr(where).encode())
            out[i, j, 1] = _hash64(data.view(np.uint8))
    return out


def _hash64(data) -> int:
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def parts_that_differ(variables) -> list:
    """The `variables` of which some part, held by several processes,
    differs between them (the same list on every process: every process
    decides from the same gathered fingerprints)."""
    if not variables:
        return []
    gathered = process_allgather([fingerprints(variables)])
    differs = differing_parts([g[0] for g in gathered])
    return [v for v, d in zip(variables, differs) if d]


def differing_parts(fingerprints) -> list:
    """For each variable, whether two processes hold the same part of it
    (the same place in the whole value) with different bytes, from every
    process's `fingerprints` (zeros: no part on that device)."""
    count = fingerprints[0].shape[0]
    result = []
    for i in range(count):
        seen = {}
        differs = False
        for process in fingerprints:
            for where, what in process[i]:
                if not where and not what:
                    continue
                if seen.setdefault(int(where), int(what)) != int(what):
                    differs = True
        result.append(differs)
    return result


def from_chief(value):
    """The chief's `value` (a host array) on every process."""
    return np.asarray(multihost_utils.broadcast_one_to_all(value))


def process_allgather(arrays) -> list:
    """Every process's `arrays` (a list of NumPy arrays of the same shapes
    everywhere), in process order, through JAX's own collective. 64-bit
    values travel as uint32 pairs (JAX computes in 32 bits by default)."""

    def words(x):
        x = np.ascontiguousarray(x)
        if x.dtype.itemsize == 8 and x.ndim:
            return x.view(np.uint32)
        return x

    stacked = multihost_utils.process_allgather([words(x) for x in arrays])
    return [
        [
            np.asarray(g[w]).view(x.dtype)
            if x.dtype.itemsize == 8 and x.ndim
            else np.asarray(g[w])
            for g, x in zip(stacked, arrays)
        ]
        for w in range(jax.process_count())
    ]
