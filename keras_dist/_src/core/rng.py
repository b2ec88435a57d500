"""Replicating the chief's host random generators on every process.

Keras's data adapters shuffle with NumPy's global generator (JAX and torch
backends), `PyDataset` with Python's `random`, a torch `DataLoader` with
torch's. For every process to draw the batches one device would draw, the
others take the chief's generator states at the start of each call (one
broadcast); the chief's generators are left as plain Keras leaves them.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

_HEAD = 6  # version, has_py_gauss, np_pos, np_has_gauss, py_gauss, np_gauss
_PY_KEYS = 625
_NP_KEYS = 624


def generator_state(extra: np.ndarray | None = None) -> np.ndarray:
    """Python's and NumPy's global generator states (and `extra`, e.g. a
    framework's) as one int64 vector, the same length on every process."""
    version, py_keys, py_gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    floats = np.array(
        [0.0 if py_gauss is None else py_gauss, np_gauss], np.float64
    ).view(np.int64)
    head = [version, int(py_gauss is not None), np_pos, np_has_gauss]
    parts = [
        np.asarray(head, np.int64),
        floats,
        np.asarray(py_keys, np.int64),
        np.asarray(np_keys, np.int64),
    ]
    if extra is not None:
        parts.append(np.asarray(extra, np.int64))
    return np.concatenate(parts)


def set_generator_state(vector: np.ndarray) -> np.ndarray:
    """Sets Python's and NumPy's generators from `generator_state`'s vector.

    Returns:
        The `extra` part of the vector (empty if there was none).
    """
    version, has_py_gauss, np_pos, np_has_gauss = (int(v) for v in vector[:4])
    py_gauss, np_gauss = vector[4:_HEAD].view(np.float64)
    py_end = _HEAD + _PY_KEYS
    np_end = py_end + _NP_KEYS
    random.setstate(
        (
            version,
            tuple(int(v) for v in vector[_HEAD:py_end]),
            float(py_gauss) if has_py_gauss else None,
        )
    )
    np.random.set_state(
        (
            "MT19937",
            vector[py_end:np_end].astype(np.uint32),
            np_pos,
            np_has_gauss,
            float(np_gauss),
        )
    )
    return vector[np_end:]


def replicate_chief_generators(
    runtime,
    get_extra: Callable[[], np.ndarray] | None = None,
    set_extra: Callable[[np.ndarray], None] | None = None,
) -> None:
    """Gives every process the chief's Python and NumPy generator states
    (and a framework's, through `get_extra`/`set_extra`).

    A no-op for a one-process runtime. Collective: every process calls it.
    """
    if runtime.world_size == 1:
        return
    extra = get_extra() if get_extra is not None else None
    vector = runtime.broadcast(generator_state(extra), 0)
    if runtime.is_chief:
        return
    rest = set_generator_state(vector)
    if set_extra is not None:
        set_extra(rest)
