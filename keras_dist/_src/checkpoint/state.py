"""What a checkpoint holds, taken from and put back into a model.

Variables are keyed by group and `variable.path` (``model/dense/kernel``,
``optimizer/adam/iteration``, ``metrics/loss/total``): the same on every
backend for the same program, so a checkpoint moves between backends and
replica counts. Where the paths differ but the variables agree in number
and shapes (a model built after others, so its layers were numbered
``dense_3``), they are matched in order, with a warning. Otherwise loading
stops with an error that names the missing, unexpected and mis-shaped
variables.

Random-generator states (Python, NumPy, torch, TensorFlow's op-seed
counter and Keras's global `SeedGenerator`) are captured as arrays under
``rng/<name>/...`` keys, so that shuffling and dropout continue exactly;
the states of the generators a model's own layers use are model
variables already.
"""

from __future__ import annotations

import platform
import random
import sys
import warnings

import keras
import numpy as np

from keras_dist._src.checkpoint.format import CheckpointMismatchError

GROUPS = ("model", "optimizer", "metrics")


# -- variables --
def variable_groups(model) -> dict:
    """``{"model": [...], "optimizer": [...], "metrics": [...]}`` variables."""
    optimizer = getattr(model, "optimizer", None)
    return {
        "model": list(model.variables),
        "optimizer": list(optimizer.variables) if optimizer else [],
        "metrics": list(getattr(model, "metrics_variables", [])),
    }


def _keys(group: str, variables) -> list[str]:
    """Unique keys ``group/path`` (``#i`` added to repeated paths)."""
    seen, keys = {}, []
    for v in variables:
        key = f"{group}/{v.path}"
        count = seen.get(key, 0)
        seen[key] = count + 1
        keys.append(key if count == 0 else f"{key}#{count}")
    return keys


def to_host(value) -> np.ndarray:
    """A NumPy copy of a variable's value (never a view of device memory).

    The backend reads the whole value (`host_array`: a mirrored variable's
    primary copy, a sharded one gathered from every device and process);
    variables are saved through `export_variables` instead.
    """
    from keras_dist._src import backends

    array = backends.get().host_array(value)
    # One copy, and only where `array` may share memory with the device
    # buffer (which the next step can overwrite or donate).
    if not array.flags.owndata or not array.flags.writeable:
        array = array.copy()
    return array


def export_variables(model, is_chief: bool = True) -> list:
    """The parts of every variable of `model` this process writes.

    Through the backend's `export_state`: no value is gathered from other
    processes (each exports the shards it owns; a whole value is exported
    by the chief).

    Returns:
        ``[{"key", "shape", "dtype", "layout", "pieces": [(start, array),
        ...]}, ...]`` in group order.
    """
    from keras_dist._src import backends

    check_built(model)
    backend = backends.get()
    placement = _placement_of(model)
    out = []
    for group, variables in variable_groups(model).items():
        for key, variable in zip(_keys(group, variables), variables):
            shape, pieces = backend.export_state(variable.value, is_chief)
            out.append(
                {
                    "key": key,
                    "shape": [int(n) for n in shape],
                    "dtype": keras.backend.standardize_dtype(variable.dtype),
                    "layout": placement(variable),
                    "pieces": pieces,
                }
            )
    return out


def whole(key: str, value) -> dict:
    """An `export_variables` entry of an array the chief holds whole (the
    random states, extra arrays)."""
    array = np.asarray(value)
    return {
        "key": key,
        "shape": list(array.shape),
        "dtype": array.dtype.name,
        "pieces": [((0,) * array.ndim, array)],
    }


def assemble(entry: dict) -> np.ndarray:
    """The whole array of an `export_variables` entry whose pieces this
    process holds all of (a job of one process)."""
    pieces = entry["pieces"]
    shape = tuple(entry["shape"])
    if len(pieces) == 1 and tuple(pieces[0][1].shape) == shape:
        return pieces[0][1]
    out = np.empty(shape, pieces[0][1].dtype)
    for start, array in pieces:
        out[tuple(slice(a, a + n) for a, n in zip(start, array.shape))] = array
    return out


def _placement_of(model):
    """A function giving a variable's layout over the strategy's mesh, as
    JSON (one entry per dimension: None, an axis name or a list of names),
    or None where the strategy has no layouts."""
    from keras_dist._src.checkpoint import runtime_glue

    strategy = runtime_glue.strategy_of(model)
    find = strategy.extended.placement if strategy is not None else None

    def placement(variable):
        if find is None:
            return None
        try:
            layout, _ = find(variable)
        except Exception:  # noqa: BLE001 - a description, never needed
            return None
        return [
            [str(n) for n in a]
            if isinstance(a, (tuple, list))
            else (None if a is None else str(a))
            for a in layout
        ]

    return placement


def check_built(model) -> None:
    """Raises a clear error for a model that has no variables yet."""
    if not getattr(model, "built", False):
        raise ValueError(
            f"Model {model.name!r} is not built, so it has no variables to "
            "save or restore. Build it first (call it on a batch, or "
            "`model.build(input_shape)`), e.g. before `fit`."
        )


def ensure_optimizer_built(model) -> None:
    """Creates the optimizer's variables (inside the model's strategy),
    each with its layout before any value is read into it (so that a
    sharded slot is never held whole)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        return
    from keras_dist._src.checkpoint import runtime_glue

    with runtime_glue.scope_of(model):
        optimizer.build(model.trainable_variables)
    runtime_glue.lay_out(model)


def match(model, arrays: dict, groups=GROUPS) -> list[tuple]:
    """Pairs the model's variables with the checkpoint's arrays.

    Returns:
        ``[(variable, array), ...]``.

    Raises:
        CheckpointMismatchError: naming the variables that do not match.
    """
    pairs = []
    problems = []
    for group, variables in variable_groups(model).items():
        if group not in groups:
            continue
        keys = _keys(group, variables)
        saved = [k for k in arrays if k.startswith(group + "/")]
        found, problem = _match_group(group, keys, variables, saved, arrays)
        pairs += found
        if problem:
            problems.append(problem)
    if problems:
        raise CheckpointMismatchError(
            f"The checkpoint does not match model {model.name!r}:\n"
            + "\n".join(problems)
            + "\nRestore into the model the checkpoint was written from "
            "(same layers, same shapes), or start from a new backup "
            "directory."
        )
    return pairs


def _dtype_kind(dtype) -> str:
    """``"float"``, ``"integer"``, ``"bool"`` or ``"complex"`` (else the
    dtype's name): what may be stored into a variable of another width."""
    name = str(getattr(dtype, "name", dtype))
    if name == "bool":
        return "bool"
    if name.startswith(("float", "bfloat")):
        return "float"
    if name.startswith(("int", "uint")):
        return "integer"
    if name.startswith("complex"):
        return "complex"
    return name


def _match_group(group, keys, variables, saved, arrays):
    shape = {k: tuple(arrays[k].shape) for k in saved}
    by_key = dict(zip(keys, variables))

    def kind_differs(key, variable):
        return _dtype_kind(arrays[key].dtype) != _dtype_kind(variable.dtype)

    if set(keys) == set(saved):
        bad = [
            f"{k} (checkpoint {shape[k]}, model {tuple(by_key[k].shape)})"
            for k in keys
            if shape[k] != tuple(by_key[k].shape)
        ]
        if bad:
            return [], f"  shapes differ: {', '.join(bad)}"
        kinds = [
            f"{k} (checkpoint {arrays[k].dtype}, model {by_key[k].dtype})"
            for k in keys
            if kind_differs(k, by_key[k])
        ]
        if kinds:
            return [], f"  dtypes of another kind: {', '.join(kinds)}"
        return [(by_key[k], arrays[k]) for k in keys], None
    same_order = len(keys) == len(saved) and all(
        shape[s] == tuple(v.shape) and not kind_differs(s, v)
        for s, v in zip(saved, variables)
    )
    if same_order:
        renamed = [(s, k) for s, k in zip(saved, keys) if s != k]
        warnings.warn(
            f"The {group} variables' paths differ from the checkpoint's "
            f"({len(renamed)} of {len(keys)}, e.g. {renamed[0][0]!r} is "
            f"{renamed[0][1]!r} here) but their number and shapes agree: "
            "matching them in order.",
            stacklevel=4,
        )
        return [(v, arrays[s]) for s, v in zip(saved, variables)], None
    missing = [k for k in keys if k not in shape]
    unexpected = [k for k in saved if k not in by_key]
    reshaped = [
        f"{k} (checkpoint {shape[k]}, model {tuple(by_key[k].shape)})"
        for k in keys
        if k in shape and shape[k] != tuple(by_key[k].shape)
    ]
    kinds = [
        f"{k} (checkpoint {arrays[k].dtype}, model {by_key[k].dtype})"
        for k in keys
        if k in shape
        and shape[k] == tuple(by_key[k].shape)
        and kind_differs(k, by_key[k])
    ]
    lines = []
    if kinds:
        lines.append(f"  dtypes of another kind: {', '.join(kinds)}")
    if missing:
        lines.append(f"  missing from the checkpoint: {', '.join(missing)}")
    if unexpected:
        lines.append(f"  not in the model: {', '.join(unexpected)}")
    if reshaped:
        lines.append(f"  shapes differ: {', '.join(reshaped)}")
    return [], "\n".join(lines)


def assign(pairs) -> None:
    """Assigns each array to its variable (in the variable's dtype).

    Through the backend's `import_state`: each process reads only the
    regions of a saved array (a `reading.SavedArray` of a sharded
    checkpoint, or a NumPy array) its own part of the variable needs.
    """
    from keras_dist._src import backends

    backend = backends.get()
    for variable, array in pairs:
        if hasattr(array, "read"):
            reader = array.read
        else:
            array = np.asarray(array)

            def reader(index, array=array):
                return array if index is None else array[tuple(index)]

        backend.import_state(variable, reader)


# -- random generators --
def capture_rng() -> dict:
    """The states of the global random generators, as ``rng/...`` arrays."""
    out = {}
    version, internal, gauss = random.getstate()
    out["rng/python/state"] = np.asarray(internal, np.int64)
    out["rng/python/gauss"] = np.asarray(
        [np.nan if gauss is None else gauss], np.float64
    )
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out["rng/numpy/keys"] = np.asarray(keys, np.uint32)
    out["rng/numpy/extra"] = np.asarray([pos, has_gauss, cached], np.float64)
    if "torch" in sys.modules:
        import torch

        out["rng/torch/cpu"] = torch.get_rng_state().numpy().copy()
    tf_rng = _tf_context_rng()
    if tf_rng is not None:
        _, internal, _ = tf_rng.getstate()
        out["rng/tensorflow/op_seed"] = np.asarray(internal, np.int64)
    generator = _keras_global_seed_generator()
    if generator is not None:
        out["rng/keras/global_seed_generator"] = to_host(generator.state.value)
    return out


def restore_rng(arrays: dict) -> None:
    """Sets the global random generators from `capture_rng`'s arrays.

    Generators absent from `arrays` (e.g. torch's in a checkpoint written
    where torch was not imported), or not installed here, are left as they
    are.
    """
    if "rng/python/state" in arrays:
        gauss = float(arrays["rng/python/gauss"][0])
        random.setstate(
            (
                3,
                tuple(int(i) for i in arrays["rng/python/state"]),
                None if np.isnan(gauss) else gauss,
            )
        )
    if "rng/numpy/keys" in arrays:
        pos, has_gauss, cached = arrays["rng/numpy/extra"]
        np.random.set_state(
            (
                "MT19937",
                arrays["rng/numpy/keys"].astype(np.uint32),
                int(pos),
                int(has_gauss),
                float(cached),
            )
        )
    if "rng/torch/cpu" in arrays:
        # Saved wherever torch was in use, whatever the backend (a torch
        # DataLoader's shuffle feeding a JAX model draws from it).
        try:
            import torch
        except ImportError:  # written where torch is, read where it is not
            torch = None
        if torch is not None:
            state = torch.from_numpy(arrays["rng/torch/cpu"].copy())
            torch.set_rng_state(state)
    tf_rng = _tf_context_rng()
    if "rng/tensorflow/op_seed" in arrays and tf_rng is not None:
        state = tuple(int(i) for i in arrays["rng/tensorflow/op_seed"])
        tf_rng.setstate((3, state, None))
    generator = _keras_global_seed_generator()
    key = "rng/keras/global_seed_generator"
    if key in arrays and generator is not None:
        if tuple(generator.state.shape) == arrays[key].shape:
            generator.state.assign(arrays[key])


def _tf_context_rng():
    """TensorFlow's eager op-seed generator (a `random.Random`), if set."""
    from keras_dist._src import backends as backend_lib

    generator = backend_lib.capabilities().op_seed_generator
    if generator is None:
        return None
    try:
        rng = generator()
    except ImportError:  # pragma: no cover
        return None
    return rng if isinstance(rng, random.Random) else None


def _keras_global_seed_generator():
    from keras_dist._src.keras_glue import internals

    return internals.global_seed_generator()


def rng_arrays(arrays: dict, prefix: str = "rng/") -> dict:
    """The subset of `arrays` whose keys start with `prefix`."""
    return {k: v for k, v in arrays.items() if k.startswith(prefix)}


def prefixed(arrays: dict, prefix: str) -> dict:
    """`arrays` with `prefix` added to every key."""
    return {prefix + k: v for k, v in arrays.items()}


def unprefixed(arrays: dict, prefix: str) -> dict:
    """The arrays under `prefix`, with the prefix removed."""
    n = len(prefix)
    return {k[n:]: v for k, v in arrays.items() if k.startswith(prefix)}


# -- versions --
def versions() -> dict:
    """Versions of keras_dist, Keras, the backend framework and Python."""
    from keras_dist._src import backends as backend_lib
    from keras_dist._src.version import __version__

    backend = backend_lib.name()
    module = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}.get(
        backend
    )
    framework = getattr(sys.modules.get(module), "__version__", None)
    return {
        "keras_dist": __version__,
        "keras": keras.__version__,
        "backend": backend,
        "backend_version": framework,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
