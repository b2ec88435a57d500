"""Replicating the chief's host random generators on every process.

Keras's data adapters shuffle with NumPy's global generator (JAX and torch
backends) and `PyDataset` with Python's `random`. For every process to draw
the batches one device would draw, the others take the chief's generator
states at the start of each call; the chief's generators (and so what one
device would draw) are left as they are.
"""

from __future__ import annotations

import random

import numpy as np


def replicate_chief_generators(runtime) -> None:
    """Sets NumPy's and Python's global generators to the chief's states.

    A no-op for a one-process runtime. Collective: every process calls it.
    """
    if runtime.world_size == 1:
        return
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    state = {
        "np_keys": np.asarray(keys, np.int64),
        "np_pos": int(pos),
        "np_has_gauss": int(has_gauss),
        "np_gauss": float(gauss),
        "py_words": np.asarray(words, np.int64),
        "py_has_next": int(gauss_next is not None),
        "py_next": float(gauss_next or 0.0),
    }
    chief = runtime.broadcast(state, root=0)
    if runtime.is_chief:
        return
    np.random.set_state(
        (
            kind,
            chief["np_keys"].astype(np.uint32),
            chief["np_pos"],
            chief["np_has_gauss"],
            chief["np_gauss"],
        )
    )
    random.setstate(
        (
            version,
            tuple(int(w) for w in chief["py_words"]),
            chief["py_next"] if chief["py_has_next"] else None,
        )
    )
