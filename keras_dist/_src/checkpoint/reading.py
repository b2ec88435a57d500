"""Reading a checkpoint's arrays: both format versions, one path.

Version 1 stores each array whole, as one member of ``arrays.npz``;
version 2 (sharded, written by `shards`) stores each array as pieces
(start offsets and a shape) in the ``shards-<rank>.npz`` files of the
processes that owned them. Read here, a version-1 array is one of a single
piece: the checks of the metadata's files, arrays and pieces, of every
stored member's header, and the region-by-region reads (`SavedArray`: each
process reads only the parts its variables hold) are the same for both.
Nothing is trusted: every field is validated before a file is touched, and
what a damaged file raises becomes a `CheckpointCorruptError`.
"""

from __future__ import annotations

import math
import os
import re
import sys
import zipfile

import numpy as np

from keras_dist._src.checkpoint.base import (
    ARRAYS_FILE,
    CHUNK,
    COMMIT_FILE,
    DTYPES,
    FILE_NAME,
    MEMBER_NAME,
    METADATA_FILE,
    ML_DTYPES,
    READ_ERRORS,
    SHA256,
    SINGLE_FILE_VERSION,
    CheckpointCorruptError,
    CheckpointError,
    file_digest,
    invalid,
    is_int,
    numpy_dtype,
    stored_dtype,
    valid_shape,
)

#: Groups whose arrays are read lazily, part by part (`SavedArray`).
VARIABLE_GROUPS = ("model/", "optimizer/", "metrics/")


def data_files(metadata: dict) -> list[str]:
    """The array files of a checkpoint: ``arrays.npz`` (version 1), every
    file its metadata lists (version 2)."""
    if metadata["format_version"] == SINGLE_FILE_VERSION:
        return [ARRAYS_FILE]
    return list(metadata["files"])


def pieces(metadata: dict, entry: dict) -> list:
    """The pieces (``{"file", "name", "start", "shape"}``) of an array
    entry; a version-1 array is one whole piece of ``arrays.npz``."""
    if metadata["format_version"] == SINGLE_FILE_VERSION:
        shape = entry["shape"]
        return [
            {
                "file": ARRAYS_FILE,
                "name": entry["name"],
                "start": [0] * len(shape),
                "shape": shape,
            }
        ]
    return entry["pieces"]


# -- the metadata --
def check_arrays(path: str, metadata: dict) -> None:
    """Validates a metadata's ``files`` and ``arrays`` (either version):
    file names without separators, sizes and checksums; every array's key,
    dtype (from `DTYPES`) and shape; pieces that lie inside the shape, in
    listed files, and cover it exactly once.

    Raises:
        CheckpointCorruptError: naming the defect.
    """
    single = metadata["format_version"] == SINGLE_FILE_VERSION
    files = metadata.get("files")
    if single and (not isinstance(files, dict) or ARRAYS_FILE not in files):
        raise invalid(path, f"its metadata lists no {ARRAYS_FILE!r} file")
    if not isinstance(files, dict) or not files:
        raise invalid(path, "its metadata lists no shard files")
    for name, info in files.items():
        if (
            not isinstance(name, str)
            or not FILE_NAME.match(name)
            or len(name) > 128
            or name in (COMMIT_FILE, METADATA_FILE)
        ):
            raise invalid(path, f"its metadata names a file {name!r}")
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("sha256"), str)
            or not SHA256.match(info["sha256"])
            or not is_int(info.get("bytes"))
            or info["bytes"] < 0
        ):
            raise invalid(path, f"its metadata entry of {name!r} is {info!r}")
    entries = metadata.get("arrays")
    if not isinstance(entries, list):
        raise invalid(path, "its metadata has no list of arrays")
    keys, members, used = set(), set(), dict.fromkeys(files, 0)
    for entry in entries:
        if not isinstance(entry, dict):
            raise invalid(path, f"an array entry is {entry!r}")
        key, dtype, shape = (
            entry.get("key"),
            entry.get("dtype"),
            entry.get("shape"),
        )
        if not isinstance(key, str) or not key or key in keys:
            raise invalid(path, f"an array key is {key!r} (or repeated)")
        keys.add(key)
        if single and not (
            isinstance(entry.get("name"), str)
            and MEMBER_NAME.match(entry["name"])
        ):
            raise invalid(
                path, f"array {key!r} is stored as {entry.get('name')!r}"
            )
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise invalid(
                path,
                f"array {key!r} has dtype {dtype!r}, not one of "
                f"{', '.join(sorted(DTYPES))}",
            )
        if not valid_shape(shape):
            raise invalid(path, f"array {key!r} has shape {shape!r}")
        if not single and not isinstance(entry.get("pieces"), list):
            raise invalid(path, f"array {key!r} has no list of pieces")
        parts = pieces(metadata, entry)
        covered = 0
        for piece in parts:
            where = f"array {key!r}"
            if not single:
                where = f"a piece of array {key!r} ({piece!r})"
            _check_piece(path, where, piece, shape, files, members)
            covered += math.prod(piece["shape"])
            used[piece["file"]] += (
                math.prod(piece["shape"]) * stored_dtype(dtype).itemsize
            )
        if covered != math.prod(shape) or not pieces_disjoint(parts):
            raise invalid(
                path,
                f"the pieces of array {key!r} hold {covered} of its "
                f"{math.prod(shape)} elements (or overlap)",
            )
    for name, total in used.items():
        if total > files[name]["bytes"]:
            raise invalid(
                path,
                f"its arrays in {name} need {total} bytes but the file has "
                f"{files[name]['bytes']}",
            )


def _check_piece(path, where, piece, shape, files, members) -> None:
    """Validates one piece of an array of `shape` (see `check_arrays`)."""
    if not isinstance(piece, dict):
        raise invalid(path, f"{where} is not an object")
    file, name = piece.get("file"), piece.get("name")
    start, size = piece.get("start"), piece.get("shape")
    if not isinstance(file, str) or file not in files:
        raise invalid(path, f"{where} names an unlisted file")
    if not isinstance(name, str) or not MEMBER_NAME.match(name):
        raise invalid(path, f"{where} has member name {name!r}")
    if (file, name) in members:
        raise invalid(path, f"two arrays are stored as {file}/{name}")
    members.add((file, name))
    if (
        not valid_shape(start)
        or not valid_shape(size)
        or len(start) != len(shape)
        or len(size) != len(shape)
        or any(a + n > m for a, n, m in zip(start, size, shape))
    ):
        raise invalid(path, f"{where} lies outside shape {shape}")


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


# -- the files --
def check_digests(path: str, metadata: dict) -> None:
    """Checks the SHA-256 of every array file against the metadata.

    Raises:
        CheckpointCorruptError: naming the damaged file.
    """
    for name in data_files(metadata):
        file_path = os.path.join(path, name)
        try:
            digest = file_digest(file_path)
        except OSError as error:
            raise CheckpointCorruptError(
                f"{file_path} is unreadable: {error}"
            ) from None
        if digest["sha256"] != metadata["files"][name]["sha256"]:
            raise CheckpointCorruptError(
                f"{file_path} does not match its SHA-256 checksum: the file "
                "is damaged."
            )


def _member(entry: dict, piece: dict) -> dict:
    """What a stored member must be: its array's key and dtype, the
    piece's member name and shape."""
    return {
        "key": entry["key"],
        "name": piece["name"],
        "dtype": entry["dtype"],
        "shape": piece["shape"],
    }


def scan_member(path: str, archive, member: dict, file: str) -> None:
    """Checks one stored array's header against what its metadata says
    (`member`: ``{"key", "name", "dtype", "shape"}``)."""
    name = member["name"]
    where = f"array {member['key']!r} ({name})"
    try:
        info = archive.getinfo(name + ".npy")
    except KeyError:
        raise invalid(path, f"{file} lacks {where}") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise invalid(path, f"{where} is compressed (never written so)")
    with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            header = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            header = np.lib.format.read_array_header_2_0(f)
        else:
            raise invalid(path, f"{where} has .npy version {version}")
        shape, _, dtype = header
        start = f.tell()
    expected = stored_dtype(member["dtype"])
    if dtype != expected:
        raise invalid(
            path,
            f"{where} is stored as {dtype}, its metadata says "
            f"{member['dtype']} (stored as {expected})",
        )
    if list(shape) != member["shape"]:
        raise invalid(
            path,
            f"{where} is stored with shape {list(shape)}, its metadata "
            f"says {member['shape']}",
        )
    if info.file_size != start + math.prod(shape) * dtype.itemsize:
        raise invalid(
            path,
            f"{where} holds {info.file_size - start} bytes, its shape and "
            f"dtype need {math.prod(shape) * dtype.itemsize}",
        )


def read_npy(f, member: dict) -> np.ndarray:
    """The array stored in the open member `f` (ml_dtypes' restored)."""
    array = np.lib.format.read_array(f, allow_pickle=False)
    if member["dtype"] in ML_DTYPES:
        array = array.view(numpy_dtype(member["dtype"]))
    return array


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


def _box(piece: dict) -> list[tuple[int, int]]:
    """A piece's region, as `bounds` gives one."""
    return [(a, a + n) for a, n in zip(piece["start"], piece["shape"])]


class SavedArray:
    """An array of a checkpoint, read region by region.

    Attributes:
        key: its checkpoint key (``model/dense/kernel``).
        shape: its global shape.
        dtype: its NumPy dtype.
        layout: the layout it was saved under (as the metadata records it).
    """

    def __init__(self, source, entry, parts):
        self._source = source
        self.key = entry["key"]
        self.shape = tuple(entry["shape"])
        self.dtype = numpy_dtype(entry["dtype"])
        self.layout = entry.get("layout")
        self._entry = entry
        self._pieces = parts

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
        if self._pieces and region == _box(self._pieces[0]):
            # The region is one piece (a whole array of version 1, a
            # process's own shard): no copy.
            return self._source.piece(self._entry, self._pieces[0])
        out = np.empty([b - a for a, b in region], self.dtype)
        filled = 0
        for piece in self._pieces:
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
            f"pieces={len(self._pieces)})"
        )


class _ArrayFiles:
    """The open array files of one checkpoint."""

    def __init__(self, path: str):
        self.path = path
        self._archives = {}

    def archive(self, name: str):
        """The open zip file `name` (opened at the first use)."""
        archive = self._archives.get(name)
        if archive is None:
            try:
                archive = zipfile.ZipFile(os.path.join(self.path, name))
            except READ_ERRORS as error:
                raise CheckpointCorruptError(
                    f"{self.path}/{name} cannot be read: {error}"
                ) from None
            self._archives[name] = archive
        return archive

    def piece(self, entry: dict, piece: dict, drain: bool = False):
        """The stored array of `piece` (with `drain`: only reads it through
        to its end, which checks the zip's CRC-32, and returns None)."""
        try:
            with self.archive(piece["file"]).open(piece["name"] + ".npy") as f:
                if not drain:
                    return read_npy(f, _member(entry, piece))
                while f.read(CHUNK):
                    pass
                return None
        except CheckpointError:
            raise
        except READ_ERRORS as error:
            raise CheckpointCorruptError(
                f"{self.path}/{piece['file']} cannot be read: {error}"
            ) from None

    def close(self) -> None:
        """Closes the open files (reading again reopens them)."""
        for archive in self._archives.values():
            archive.close()
        self._archives = {}


class SavedArrays(dict):
    """``{key: array}`` of a checkpoint: the variables' arrays are
    `SavedArray` objects (read part by part: each process reads only the
    regions it holds), every other array (random states, extras) a NumPy
    array."""

    def __init__(self, files: _ArrayFiles):
        super().__init__()
        self.files = files

    def close(self) -> None:
        """Closes the open files (reading again reopens them)."""
        self.files.close()


def open_arrays(
    path: str, metadata: dict, check_data: bool = False
) -> SavedArrays:
    """Opens the arrays of a checkpoint (either version) for reading.

    Checks that every array file holds exactly the members its metadata
    lists and every member's header (dtype, shape, size), and reads the
    arrays outside the variable groups (random states, extras), whose
    random states are checked (`check_rng`).

    Args:
        path: the ``ckpt-<step>`` directory.
        metadata: its metadata (validated by `format.read_metadata`).
        check_data: also read every variable's members through (the zip's
            CRC-32s), without keeping them.

    Returns:
        A `SavedArrays` mapping.

    Raises:
        CheckpointCorruptError: naming the defect.
    """
    files = _ArrayFiles(path)
    out = SavedArrays(files)
    entries = [(e, pieces(metadata, e)) for e in metadata["arrays"]]
    wanted = {name: set() for name in data_files(metadata)}
    for _, parts in entries:
        for piece in parts:
            wanted[piece["file"]].add(piece["name"] + ".npy")
    try:
        for name, members in wanted.items():
            extra = set(files.archive(name).namelist()) - members
            if extra:
                raise invalid(
                    path,
                    f"{name} holds arrays its metadata does not list: "
                    f"{sorted(extra)[:5]}",
                )
        for entry, parts in entries:
            for piece in parts:
                archive = files.archive(piece["file"])
                scan_member(path, archive, _member(entry, piece), piece["file"])
            array = SavedArray(files, entry, parts)
            if not entry["key"].startswith(VARIABLE_GROUPS):
                out[entry["key"]] = array.read()
                continue
            out[entry["key"]] = array
            if check_data:
                for piece in parts:
                    files.piece(entry, piece, drain=True)
        check_rng(path, {k: v for k, v in out.items() if RNG_KEY.match(k)})
    except CheckpointError:
        files.close()
        raise
    except READ_ERRORS as error:
        files.close()
        raise CheckpointCorruptError(
            f"{path} cannot be read: {error}"
        ) from None
    return out


# -- random-generator states --
# The random-generator states `state.capture_rng` stores (also under a
# prefix such as ``epoch_begin/``): what their setters accept.
RNG_KEY = re.compile(r"^(?:[A-Za-z0-9_]+/)?rng/")


def check_rng(path: str, arrays: dict) -> None:
    """Checks stored random-generator states before anything is set.

    Raises:
        CheckpointCorruptError: for a state its generator would refuse.
    """
    for key, array in arrays.items():
        base = key[key.index("rng/") :]
        problem = _rng_problem(base, array)
        if problem:
            raise invalid(path, f"the random state {key!r} {problem}")


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
    elif kind not in "biuf" and array.dtype.name not in ML_DTYPES:
        return f"is {array.dtype}"
    return None
