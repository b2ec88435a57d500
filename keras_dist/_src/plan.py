"""Plans: what a strategy asks of a backend, as data.

A strategy builds one *plan*: the device mesh, the batch axis that carries
the data, and the layout of every variable. Each backend chooses its engine
from the plan's type (a registry in ``backends/<b>/__init__.py``), so adding
a strategy means a plan here, a strategy file, and one policy per backend.
Names follow `keras.distribution` (`DeviceMesh`, `LayoutMap`, axis-name
tuples), and `keras.distribution` objects are accepted as they are.

A layout is a tuple with one entry per dimension of the tensor: None (that
dimension is whole on every device), an axis name of the mesh (split over
that axis), or a tuple of axis names (split over their product).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import enum
import json
import math
import re
from collections.abc import Sequence

from keras_dist._src.errors import LayoutError


class Topology(str, enum.Enum):
    """How a strategy finds its processes: one process on one device, the
    devices of this host, or a job of workers found from the launcher.
    `runtime.membership` turns it into "alone" or "one process of a job"
    by one rule for every backend."""

    ONE_DEVICE = "one_device"
    MIRRORED = "mirrored"
    MULTI_WORKER = "multi_worker"


#: The topologies' names (`Topology` values).
TOPOLOGIES = tuple(t.value for t in Topology)


class DeviceMesh:
    """Devices arranged in a grid with named axes (Keras's `DeviceMesh`).

    Args:
        shape: the size of each axis, e.g. ``(2, 2)``.
        axis_names: one name per axis, e.g. ``("batch", "model")``.
        devices: device names (``"cpu:0"``, ...) filling the grid in order;
            None for every device of every process of the job.

    Raises:
        LayoutError: for an empty, mis-sized or repeated axis.
    """

    def __init__(self, shape, axis_names, devices=None):
        shape = tuple(int(s) for s in shape)
        axis_names = tuple(str(a) for a in axis_names)
        if not shape or len(shape) != len(axis_names):
            raise LayoutError(
                f"A DeviceMesh needs one name per axis: got shape {shape} and "
                f"axis_names {axis_names}."
            )
        if any(s < 1 for s in shape):
            raise LayoutError(f"Mesh axis sizes must be >= 1; got {shape}.")
        repeated = {a for a in axis_names if axis_names.count(a) > 1}
        if repeated:
            raise LayoutError(
                f"Mesh axis names must be distinct; {sorted(repeated)} "
                f"appears more than once in {axis_names}."
            )
        if devices is not None:
            devices = tuple(_device_name(d) for d in _flat(devices))
            if len(devices) != math.prod(shape):
                raise LayoutError(
                    f"A mesh of shape {shape} needs {math.prod(shape)} "
                    f"devices; got {len(devices)}: {list(devices)}."
                )
        self.shape = shape
        self.axis_names = axis_names
        self.devices = devices

    @classmethod
    def from_any(cls, mesh) -> DeviceMesh:
        """A `DeviceMesh` from ours or from `keras.distribution`'s."""
        if isinstance(mesh, DeviceMesh):
            return mesh
        if hasattr(mesh, "axis_names") and hasattr(mesh, "shape"):
            devices = getattr(mesh, "devices", None)
            return cls(mesh.shape, mesh.axis_names, devices)
        raise TypeError(
            "Expected a keras_dist.DeviceMesh or keras.distribution."
            f"DeviceMesh; got {type(mesh).__name__}."
        )

    @property
    def size(self) -> int:
        """Number of devices in the mesh."""
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        """The size of axis `name`."""
        return self.shape[self.axis_names.index(name)]

    def with_devices(self, devices: Sequence[str]) -> DeviceMesh:
        """This mesh filled with `devices` (when it named none)."""
        if self.devices is not None:
            return self
        return DeviceMesh(self.shape, self.axis_names, devices)

    def __eq__(self, other):
        return isinstance(other, DeviceMesh) and (
            self.shape,
            self.axis_names,
            self.devices,
        ) == (other.shape, other.axis_names, other.devices)

    def __hash__(self):
        return hash((self.shape, self.axis_names, self.devices))

    def __repr__(self):
        return (
            f"DeviceMesh(shape={self.shape}, axis_names={self.axis_names}"
            + (f", devices={list(self.devices)}" if self.devices else "")
            + ")"
        )


def _flat(devices):
    if hasattr(devices, "flatten"):  # a NumPy array (Keras's meshes)
        devices = devices.flatten().tolist()
    return list(devices)


def _device_name(device) -> str:
    if isinstance(device, str):
        from keras_dist._src.devices import normalize_device

        return normalize_device(device)
    # A backend device object (jax.Device): "platform:id".
    platform = getattr(device, "platform", None)
    if platform is not None:
        return f"{platform}:{device.id}"
    raise LayoutError(f"Cannot read a device name from {device!r}.")


def normalize_layout(layout, mesh: DeviceMesh, where: str) -> tuple:
    """Checks a layout against `mesh`; returns it as a tuple.

    Accepts a tuple/list of axis names and None, a
    `keras.distribution.TensorLayout`, or None (replicated, any rank).

    Raises:
        LayoutError: for an unknown axis or an axis used twice.
    """
    if layout is None:
        return None
    if hasattr(layout, "axes") and not isinstance(layout, (tuple, list)):
        layout = layout.axes
    if isinstance(layout, str) or not isinstance(layout, (tuple, list)):
        raise LayoutError(
            f"The layout of {where} must be a tuple with one entry per "
            f"dimension (an axis name, a tuple of names, or None), e.g. "
            f"(None, 'model'); got {layout!r}."
        )
    used = []
    out = []
    for entry in layout:
        names = (entry,) if isinstance(entry, str) else entry
        if entry is not None and not (
            isinstance(names, (tuple, list))
            and all(isinstance(n, str) for n in names)
        ):
            raise LayoutError(
                f"The layout {tuple(layout)!r} of {where} has the entry "
                f"{entry!r}: use an axis name, a tuple of names, or None."
            )
        for name in names or ():
            if name not in mesh.axis_names:
                raise LayoutError(
                    f"The layout {tuple(layout)!r} of {where} names the axis "
                    f"{name!r}, which the mesh does not have (its axes: "
                    f"{mesh.axis_names})."
                )
            if name in used:
                raise LayoutError(
                    f"The layout {tuple(layout)!r} of {where} uses the axis "
                    f"{name!r} twice; each mesh axis can split one "
                    "dimension only."
                )
            used.append(name)
        out.append(tuple(names) if isinstance(entry, (tuple, list)) else entry)
    return tuple(out)


class LayoutMap(collections.abc.MutableMapping):
    """Maps variable paths (regular expressions) to layouts over a mesh.

    Keras's semantics: a path matches a key exactly, or else by
    `re.fullmatch`; a path that matches several keys is an error, one that
    matches none is replicated. Unlike Keras, a key that matches no variable
    of the model is an error when the model is attached (a typo would
    otherwise silently replicate everything); pass
    ``allow_unmatched=True`` to allow it.

    A key ending in ``"/output"`` (Keras's convention, e.g.
    ``"dense.*/output"``) lays out the output of each layer whose call path
    (the layer's name, after those of the models and layers that call it)
    plus ``"/output"`` matches it, inside the step; it applies to layer
    outputs only, and the other keys to variables only (Keras would also
    apply a variable key to an output whose path it matches).

    Args:
        device_mesh: a `DeviceMesh` (ours or `keras.distribution`'s).
        allow_unmatched: accept keys that match no variable.
    """

    def __init__(self, device_mesh, allow_unmatched: bool = False):
        self.device_mesh = DeviceMesh.from_any(device_mesh)
        self.allow_unmatched = bool(allow_unmatched)
        self._layouts = {}

    @classmethod
    def from_any(cls, layout_map) -> LayoutMap:
        """A `LayoutMap` from ours or from `keras.distribution`'s."""
        if isinstance(layout_map, LayoutMap):
            return layout_map
        if hasattr(layout_map, "device_mesh") and isinstance(
            layout_map, collections.abc.Mapping
        ):
            out = cls(layout_map.device_mesh)
            for key in layout_map:
                out[key] = layout_map[key]
            return out
        raise TypeError(
            "Expected a keras_dist.LayoutMap or keras.distribution.LayoutMap; "
            f"got {type(layout_map).__name__}."
        )

    def __setitem__(self, key, layout):
        if not isinstance(key, str):
            raise LayoutError(f"LayoutMap keys are strings; got {key!r}.")
        try:
            re.compile(key)
        except re.error as error:
            raise LayoutError(
                f"LayoutMap key {key!r} is not a valid regular expression: "
                f"{error}."
            ) from None
        if key in self._layouts:
            raise LayoutError(f"LayoutMap key {key!r} is set already.")
        self._layouts[key] = normalize_layout(
            layout, self.device_mesh, f"key {key!r}"
        )

    def __getitem__(self, path):
        key = self.key_for(path)
        return None if key is None else self._layouts[key]

    def key_for(self, path: str) -> str | None:
        """The key whose layout applies to `path`, or None.

        Raises:
            LayoutError: when `path` matches several keys.
        """
        if path in self._layouts:
            return path
        output = is_output_path(path)
        keys = [
            k
            for k in self._layouts
            if is_output_path(k) == output and re.fullmatch(k, path)
        ]
        if len(keys) > 1:
            what = "Layer output path" if output else "Variable path"
            raise LayoutError(
                f"{what} {path!r} matches several LayoutMap keys: "
                f"{keys}. Make the keys specific enough that each path "
                "matches at most one."
            )
        return keys[0] if keys else None

    def __delitem__(self, key):
        del self._layouts[key]

    def __iter__(self):
        return iter(self._layouts)

    def __len__(self):
        return len(self._layouts)

    def __repr__(self):
        return f"LayoutMap({self.device_mesh!r}, {dict(self._layouts)!r})"


#: What ends a LayoutMap key for layer outputs, and the path of a layer's
#: output (Keras's convention: ``layout_map["dense.*/output"] = ...``).
OUTPUT_SUFFIX = "/output"


def is_output_path(path: str) -> bool:
    """Whether `path` (a LayoutMap key or a path looked up) names a layer's
    output (ends in ``"/output"``), not a variable."""
    return path.endswith(OUTPUT_SUFFIX)


def layer_output_paths(model, flatten) -> list[str]:
    """Every path that a layer's output of `model` may have at call time
    (Keras's ``current_path() + "/output"``): for each layer, its name
    after any run of the names of the layers and models that contain it
    (a functional model's call adds no name of its own; a subclassed
    model's does).

    Args:
        model: a Keras model.
        flatten: ``flatten(layer)`` lists every layer inside `layer`,
            nested ones included.
    """
    inside = {id(model): {id(x) for x in flatten(model)}}
    layers = [model] + list(flatten(model))
    for layer in layers[1:]:
        inside[id(layer)] = {id(x) for x in flatten(layer)}
    out = []
    for layer in layers:
        outer = sorted(
            (p for p in layers if id(layer) in inside[id(p)]),
            key=lambda p: -len(inside[id(p)]),
        )
        names = [p.name for p in outer] + [layer.name]
        for start in range(len(names)):
            out.append("/".join(names[start:]) + OUTPUT_SUFFIX)
    return sorted(set(out))


# -- plans ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    """What a strategy asks of a backend (the base of every plan type).

    Attributes:
        topology: how processes are found (`TOPOLOGIES`).
        devices: this process's devices (one device on torch).
        mesh: the mesh over every device of every process, or None where
            the backend builds its own data-parallel one.
        batch_axis: the mesh axis that splits each global batch.
        sync_batch_norm: BatchNormalization over the global batch.
    """

    topology: str
    devices: tuple
    mesh: DeviceMesh | None = None
    batch_axis: str | None = None
    sync_batch_norm: bool = True

    def variable_layout(self, path: str, shape: tuple) -> tuple | None:
        """The layout of the variable at `path` (None: replicated)."""
        del path, shape
        return None

    def data_layout(self, rank: int) -> tuple:
        """The layout of a batch array of `rank` dimensions."""
        if rank == 0 or self.batch_axis is None:
            return (None,) * rank
        return (self.batch_axis,) + (None,) * (rank - 1)


@dataclasses.dataclass(frozen=True)
class ReplicatedPlan(Plan):
    """Every variable mirrored on every device; batches split (Mirrored,
    MultiWorkerMirrored, OneDevice)."""


@dataclasses.dataclass(frozen=True)
class LayoutPlan(Plan):
    """Variables laid out over a mesh by a `LayoutMap` (ModelParallel)."""

    layout_map: LayoutMap | None = None

    def variable_layout(self, path, shape):
        return self.layout_map[path]

    def unmatched_keys(self, paths: Sequence[str]) -> list[str]:
        """Keys of the layout map that match none of `paths` (variable keys
        against variable paths, ``"/output"`` keys against layer output
        paths)."""
        hit = {self.layout_map.key_for(p) for p in paths}
        output = any(is_output_path(p) for p in paths)
        return [
            k
            for k in self.layout_map
            if k not in hit and is_output_path(k) == output
        ]

    def output_keys(self) -> list[str]:
        """The keys that lay out layer outputs (``"…/output"``)."""
        return [k for k in self.layout_map if is_output_path(k)]

    def output_layout(self, path: str) -> tuple | None:
        """The layout of the layer output at `path` (``"…/output"``), or
        None where no ``"/output"`` key matches it."""
        return self.layout_map[path] if self.output_keys() else None


@dataclasses.dataclass(frozen=True)
class ShardedPlan(Plan):
    """ZeRO-3/FSDP style: each variable of at least `min_size` elements is
    split over the batch axis along its largest dimension that the axis
    divides; smaller ones are replicated (ShardedDataParallel)."""

    min_size: int = 1024

    def variable_layout(self, path, shape):
        del path
        n = self.mesh.axis_size(self.batch_axis)
        if n == 1 or math.prod(shape) < self.min_size:
            return None
        divisible = [d for d, size in enumerate(shape) if size % n == 0]
        if not divisible:
            return None
        dim = max(divisible, key=lambda d: (shape[d], -d))
        layout = [None] * len(shape)
        layout[dim] = self.batch_axis
        return tuple(layout)


# -- checks and descriptions shared by every backend ---------------------------
def axis_product(mesh: DeviceMesh, entry) -> int:
    """How many parts a layout entry splits its dimension into."""
    if entry is None:
        return 1
    names = (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.axis_size(n) for n in names)


def check_variable_layout(plan: Plan, path: str, shape, layout) -> tuple:
    """The full-rank layout of a variable; errors name what cannot hold.

    Raises:
        LayoutError: for a layout of the wrong rank, or a dimension that
            its axes do not divide.
    """
    shape = tuple(int(s) for s in shape)
    if layout is None:
        return (None,) * len(shape)
    layout = normalize_layout(layout, plan.mesh, f"variable {path!r}")
    if len(layout) != len(shape):
        raise LayoutError(
            f"The layout {layout} for variable {path!r} has {len(layout)} "
            f"entries, but the variable has shape {shape} ({len(shape)} "
            "dimensions). Give one entry per dimension."
        )
    for dim, (size, entry) in enumerate(zip(shape, layout)):
        parts = axis_product(plan.mesh, entry)
        if size % parts:
            raise LayoutError(
                f"Variable {path!r} of shape {shape} cannot be split along "
                f"dimension {dim} (size {size}) over axis {entry!r} of "
                f"{parts} devices: {size} is not divisible by {parts}. Change "
                "the layout, the mesh shape, or the layer's size."
            )
    return layout


def check_unmatched(plan: Plan, paths: Sequence[str], what: str) -> None:
    """Raises when a LayoutMap key matches none of `paths`, or when the
    map has no key at all (it would shard nothing). `paths` are variable
    paths (checking the variable keys) or layer output paths
    (`layer_output_paths`, checking the ``"/output"`` keys).

    Raises:
        LayoutError: naming each such key and the nearest paths (or the
            key that takes the paths it matches).
    """
    if not isinstance(plan, LayoutPlan):
        return
    if not len(plan.layout_map):
        raise LayoutError(
            f"The LayoutMap of this ModelParallel is empty, so it would shard "
            f"no variable of {what}: every device would hold every variable. "
            "Add keys (regular expressions over `variable.path`) with "
            "layouts, or use MirroredStrategy for data parallelism alone."
        )
    if plan.layout_map.allow_unmatched:
        return
    unmatched = plan.unmatched_keys(paths)
    if not unmatched:
        return
    lines = []
    for key in unmatched:
        taken = {
            p: plan.layout_map.key_for(p) for p in paths if re.fullmatch(key, p)
        }
        if taken:
            # Every path it matches has an exact key (which wins).
            lines.append(
                f"  {key!r} matches {sorted(taken)[:3]}, but exact keys "
                f"take them first ({sorted(set(taken.values()))[:3]})"
            )
            continue
        near = difflib.get_close_matches(key, paths, n=3, cutoff=0.0)
        lines.append(f"  {key!r} (nearest paths: {near})")
    if any(is_output_path(p) for p in paths):
        raise LayoutError(
            f"These LayoutMap \"/output\" keys match no layer output of "
            f"{what}, so they would lay out nothing:\n" + "\n".join(lines)
            + "\nAn output key is a regular expression matched against the "
            "whole path of a layer's output at call time: the layer's name, "
            "after those of the subclassed models and layers that call it, "
            "then \"/output\" (e.g. \"dense.*/output\"). Fix the keys, or "
            "pass `LayoutMap(mesh, allow_unmatched=True)`."
        )  # fmt: skip
    raise LayoutError(
        f"These LayoutMap keys match no variable of {what}, so they would "
        "shard nothing:\n" + "\n".join(lines) + "\nKeys are regular "
        "expressions matched against the whole `variable.path` (print "
        "`[v.path for v in model.variables]`). Fix the keys, or pass "
        "`LayoutMap(mesh, allow_unmatched=True)` to allow keys that match "
        "nothing (each model is checked on its own: a map shared by "
        "several models in one scope needs it)."
    )


def check_same_on_every_process(runtime, entries, what: str) -> None:
    """Fails on every process, naming the first difference, when the
    processes would lay out different variables in this place.

    Keras names layers from a per-process counter, so a layer created on
    some processes only (before the model) shifts the names that LayoutMap
    keys match there, and the processes split different variables
    (measured: gloo aborted on torch, JAX waited until the liveness
    timeout and blamed a hung worker). One `runtime.all_gather` of a
    string; call it on every process in the same order.

    Args:
        runtime: the job's Runtime (`all_gather`, `rank`, `world_size`).
        entries: ``[(path, shape, layout)]`` of this process, in order.
        what: the model, for the message.

    Raises:
        LayoutError: on every process, with the first difference and the
            fix.
    """
    if runtime.world_size <= 1:
        return
    mine = [
        [str(path), [int(n) for n in shape], list(layout or ())]
        for path, shape, layout in entries
    ]
    everyone = [json.loads(t) for t in runtime.all_gather(json.dumps(mine))]
    first = [entry[1:] for entry in everyone[0]]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if [entry[1:] for entry in theirs] == first:
            continue
        if len(theirs) != len(first):
            detail = (
                f"rank 0 has {len(first)} variables to lay out and rank "
                f"{rank} has {len(theirs)}"
            )
        else:
            i = next(
                i
                for i, (a, b) in enumerate(zip(everyone[0], theirs))
                if a[1:] != b[1:]
            )

            def show(entry):
                path, shape, layout = entry
                return f"{path!r} {tuple(shape)} laid out {tuple(layout)}"

            detail = (
                f"variable {i} is {show(everyone[0][i])} on rank 0, but "
                f"{show(theirs[i])} on rank {rank}"
            )
        raise LayoutError(
            f"The layouts of {what} differ between processes: {detail}. "
            "Every process must build the same model with the same "
            "layouts. Keras names layers from a per-process counter, so a "
            "layer created on some processes only (before the model) "
            "shifts the names LayoutMap keys match: create the same layers "
            "in the same order on every process, or give the layers "
            "explicit names (`name=`) and match those."
        )


def bytes_per_device(plan: Plan, shape, layout, itemsize: int) -> int:
    """Bytes of one device's shard of a variable laid out by `layout`."""
    parts = 1
    for entry in layout or ():
        parts *= axis_product(plan.mesh, entry) if plan.mesh else 1
    return math.prod(shape) * itemsize // parts


# -- CentralStorage and TPU plans ---------------------------------------------
@dataclasses.dataclass(frozen=True)
class CentralStoragePlan(Plan):
    """Every variable held once, off the compute devices (the parameter
    device on TensorFlow, host memory on JAX); each replica computes on its
    own device with the global batch split (CentralStorageStrategy).

    Attributes:
        parameter_device: where the variables live; None for the backend's
            choice (the CPU, or the one compute device).
    """

    parameter_device: str | None = None


@dataclasses.dataclass(frozen=True)
class TPUPlan(Plan):
    """Data parallel (or laid out by `layout_map`) over a TPU mesh built
    from the chips' physical topology (TPUStrategy).

    Attributes:
        tpu: the TPU to reach (a name or ``grpc://`` address for
            TensorFlow's `TPUClusterResolver`); None for this VM's.
        mesh_shape: the size of each mesh axis; None for one data axis
            over every chip.
        axis_names: one name per mesh axis; the first carries the batch
            and spans the slices (DCN) when there are several.
        layout_map: variable layouts over the mesh (None: replicated).
    """

    tpu: str | None = None
    mesh_shape: tuple | None = None
    axis_names: tuple | None = None
    layout_map: LayoutMap | None = None


# -- parameter servers -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ParameterServerPlan(Plan):
    """Variables held on parameter-server tasks, steps run asynchronously by
    worker tasks that a coordinator (this process, the chief) schedules
    (ParameterServerStrategy).

    Attributes:
        cluster: ``{"chief": [...], "worker": [...], "ps": [...]}``
            addresses of every task (as in ``TF_CONFIG``).
        variable_partitioner: splits large variables into shards over the
            ps tasks (a `tf.distribute` partitioner), or None.
    """

    cluster: dict | None = None
    variable_partitioner: object = None
