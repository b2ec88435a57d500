"""A checkpoint reader that trusts nothing: damaged and hand-edited files.

A valid ``ckpt-3`` and a newer ``ckpt-5`` are written once; then
``ckpt-5``'s metadata, COMMIT marker and arrays are mutated (seeded, 200
cases, most with their checksums redone so that only validation can catch
them). For each case `latest()` and `restore()` must agree on the
checkpoint, raise nothing but the documented `CheckpointError`s, warn
once naming the defect when they skip one, and open or stat no file
outside the checkpoint directory.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import warnings

import keras
import ml_dtypes  # noqa: F401  (imported before file access is recorded)
import numpy as np
import pytest

from keras_dist import checkpoint
from keras_dist._src.checkpoint import format as fmt

CASES = 200


def _model():
    keras.backend.clear_session()
    keras.utils.set_random_seed(4)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)],
        name="fuzzed",
    )
    model.compile(optimizer="adam", loss="mse", run_eagerly=True)
    model.fit(np.ones((8, 4)), np.ones((8, 2)), batch_size=8, verbose=0)
    return model


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The model, the pristine checkpoints and the parts of ``ckpt-5``."""
    base = tmp_path_factory.mktemp("fuzz")
    pristine = base / "pristine"
    model = _model()
    checkpoint.save(model, pristine, step=3)
    model.fit(np.ones((8, 4)), np.zeros((8, 2)), batch_size=8, verbose=0)
    checkpoint.save(model, pristine, step=5)
    newest = pristine / "ckpt-5"
    meta = json.loads((newest / fmt.METADATA_FILE).read_text())
    commit = json.loads((newest / fmt.COMMIT_FILE).read_text())
    with np.load(newest / fmt.ARRAYS_FILE, allow_pickle=False) as z:
        members = {name: z[name] for name in z.files}
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s" * 64)
    random_state = random.getstate(), np.random.get_state()
    yield {
        "base": base,
        "pristine": pristine,
        "model": model,
        "meta": meta,
        "commit": commit,
        "members": members,
    }
    random.setstate(random_state[0])
    np.random.set_state(random_state[1])


# -- mutations ---------------------------------------------------------------
JUNK = [
    None,
    -1,
    0,
    1.5,
    True,
    10**30,
    "x",
    "",
    [],
    {},
    [1, "a"],
    {"bytes": 1},
    "../../outside/secret",
    "object",
    float("nan"),
]
NAMES = [
    "../../outside/secret",
    "../ckpt-3/arrays.npz",
    "..",
    ".",
    "sub/arrays.npz",
    "a\\b",
    "/abs/secret",
    "arrays.npz\x00",
    "COMMIT",
    "metadata.json",
]
DTYPES = ["object", "O", "int64", "float64", "<U3", "V8", "S4", "M8"]
DTYPES += ["float128", "bfloat16", "int4", "bool", "complex64"]


def _nodes(value, path=()):
    """Every (container, key) pair in a JSON value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield value, k
            yield from _nodes(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield value, i
            yield from _nodes(v, path + (i,))


def m_delete(rng, case):
    nodes = list(_nodes(case["meta"]))
    container, key = rng.choice(nodes)
    del container[key]


def m_junk(rng, case):
    container, key = rng.choice(list(_nodes(case["meta"])))
    container[key] = rng.choice(JUNK)


def m_file_name(rng, case):
    files = case["meta"].get("files")
    if isinstance(files, dict):
        info = {"bytes": 64, "sha256": "0" * 64}
        files[rng.choice(NAMES)] = info


def m_rename_arrays_file(rng, case):
    files = case["meta"].get("files")
    if isinstance(files, dict) and fmt.ARRAYS_FILE in files:
        files[rng.choice(NAMES)] = files.pop(fmt.ARRAYS_FILE)


def m_dtype(rng, case):
    entry = rng.choice(case["meta"]["arrays"])
    if isinstance(entry, dict):
        entry["dtype"] = rng.choice(DTYPES)


def m_shape(rng, case):
    entry = rng.choice(case["meta"]["arrays"])
    if isinstance(entry, dict):
        entry["shape"] = rng.choice(
            [[], [1], [10**9, 10**9], [-1], [2, 2, 2], ["2"], 7, [1.0]]
        )


def m_member_name(rng, case):
    entry = rng.choice(case["meta"]["arrays"])
    if isinstance(entry, dict):
        entry["name"] = rng.choice(["../x", "a0", "a1", "b", "", 3, "a01"])


def m_duplicate_entry(rng, case):
    arrays = case["meta"]["arrays"]
    if isinstance(arrays, list) and arrays:
        arrays.append(dict(rng.choice(arrays)))


def m_step(rng, case):
    target = rng.choice(["meta", "commit", "position"])
    value = rng.choice([3, 7, -5, "5", 5.0, None])
    if target == "meta":
        case["meta"]["step"] = value
    elif target == "commit":
        case["commit"]["step"] = value
    elif isinstance(case["meta"].get("position"), dict):
        case["meta"]["position"]["global_step"] = value


def m_version(rng, case):
    record = case[rng.choice(["meta", "commit"])]
    record[rng.choice(["format", "format_version"])] = rng.choice(
        ["other", 2, 0, "1", None, 1.0]
    )


def m_meta_text(rng, case):
    case["meta_text"] = rng.choice(
        [
            lambda s: s[: len(s) // 2],
            lambda s: "[" * 100000 + "]" * 100000,
            lambda s: "[1, 2]",
            lambda s: "\xff\xfe" + s,
            lambda s: s.replace('"', "'", 1),
        ]
    )


def m_commit_text(rng, case):
    case["commit_text"] = rng.choice(['{"step": 5', "[]", "null", "\x00\x01"])


def m_member_dtype(rng, case):
    name = rng.choice(sorted(case["members"]))
    array = case["members"][name]
    case["members"][name] = array.astype(
        rng.choice(["int32", "int8", "float64", "complex64", "bool"])
    )


def m_member_object(rng, case):
    name = rng.choice(sorted(case["members"]))
    case["pickled"] = name  # written as an object array (needs pickle)


def m_member_shape(rng, case):
    name = rng.choice(sorted(case["members"]))
    case["members"][name] = np.zeros((3, 3, 3), "float32")


def m_member_drop_or_add(rng, case):
    members = case["members"]
    if rng.random() < 0.5:
        members.pop(rng.choice(sorted(members)))
    else:
        members[rng.choice(["a999", "extra", "../x"])] = np.ones(2)


def m_kind(rng, case):
    """A consistent checkpoint whose kernel holds integers."""
    meta = case["meta"]
    for entry in meta["arrays"]:
        if isinstance(entry, dict) and entry.get("key", "").endswith("kernel"):
            name = entry["name"]
            case["members"][name] = case["members"][name].astype("int32")
            entry["dtype"] = "int32"
            return


def m_rng_values(rng, case):
    keys = {e["key"]: e["name"] for e in case["meta"]["arrays"]}
    key = rng.choice(["rng/python/state", "rng/numpy/extra", "rng/numpy/keys"])
    name = keys.get(key)
    if name is None:
        return
    array = case["members"][name].copy()
    if key == "rng/numpy/extra":
        array[0] = rng.choice([1000.0, -1.0, np.nan, 3.5])
    elif key == "rng/python/state":
        array[rng.choice([0, 624])] = rng.choice([-1, 1 << 40, 700])
    else:
        array = array[:100]
        for entry in case["meta"]["arrays"]:
            if entry.get("key") == key:
                entry["shape"] = [100]
    case["members"][name] = array


def m_bytes(rng, case):
    case["flip"] = rng.randint(1, 8)


def m_truncate(rng, case):
    case["truncate"] = rng.random()


def m_compressed(rng, case):
    case["compressed"] = True


MUTATIONS = [
    m_delete,
    m_junk,
    m_file_name,
    m_rename_arrays_file,
    m_dtype,
    m_shape,
    m_member_name,
    m_duplicate_entry,
    m_step,
    m_version,
    m_meta_text,
    m_commit_text,
    m_member_dtype,
    m_member_object,
    m_member_shape,
    m_member_drop_or_add,
    m_kind,
    m_rng_values,
    m_bytes,
    m_truncate,
    m_compressed,
]


def _write_case(world, root, case, rng):
    """Writes the pristine ``ckpt-3`` and the mutated ``ckpt-5``."""
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(world["pristine"] / "ckpt-3", root / "ckpt-3")
    path = root / "ckpt-5"
    path.mkdir()
    buffer = io.BytesIO()
    members = dict(case["members"])
    if case.get("pickled") in members:
        name = case["pickled"]
        members[name] = np.array([{"x": 1}] * 2, dtype=object)
    save = np.savez_compressed if case.get("compressed") else np.savez
    save(buffer, **members)
    raw = bytearray(buffer.getvalue())
    for _ in range(case.get("flip", 0)):
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    if "truncate" in case:
        raw = raw[: int(len(raw) * case["truncate"])]
    (path / fmt.ARRAYS_FILE).write_bytes(bytes(raw))
    meta = case["meta"]
    files = meta.get("files") if isinstance(meta, dict) else None
    if case["redo"] and isinstance(files, dict):
        info = files.get(fmt.ARRAYS_FILE)
        if isinstance(info, dict):
            info["sha256"] = hashlib.sha256(raw).hexdigest()
            info["bytes"] = len(raw)
    text = json.dumps(meta, indent=1, sort_keys=True)
    if "meta_text" in case:
        text = case["meta_text"](text)
    meta_bytes = text.encode("utf-8", "surrogateescape")
    (path / fmt.METADATA_FILE).write_bytes(meta_bytes)
    commit = case["commit"]
    if case["redo"] and isinstance(commit, dict):
        commit["metadata_sha256"] = hashlib.sha256(meta_bytes).hexdigest()
    (path / fmt.COMMIT_FILE).write_text(
        case.get("commit_text") or json.dumps(commit)
    )


@contextlib.contextmanager
def recorded_paths():
    """Records every path opened, stat'ed or listed meanwhile."""
    seen = []
    originals = {}

    def wrap(owner, name):
        original = getattr(owner, name)
        originals[(owner, name)] = original

        def recording(path=".", *args, **kwargs):
            if isinstance(path, (str, bytes, os.PathLike)):
                seen.append(os.fsdecode(os.fspath(path)))
            return original(path, *args, **kwargs)

        setattr(owner, name, recording)

    for owner, name in [
        (builtins, "open"),
        (io, "open"),
        (os, "open"),
        (os, "stat"),
        (os, "lstat"),
        (os, "listdir"),
        (os, "scandir"),
    ]:
        wrap(owner, name)
    try:
        yield seen
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


def _skips(record, path):
    text = f"Skipping checkpoint {path}"
    return [w for w in record if text in str(w.message)]


@pytest.mark.slow
def test_fuzzed_checkpoints_are_skipped_or_refused(world):
    model, base = world["model"], world["base"]
    root = base / "case"
    newest, older = str(root / "ckpt-5"), str(root / "ckpt-3")
    rng = random.Random(20261201)
    outcomes = {"newest": 0, "skipped": 0, "mismatch": 0}
    for i in range(CASES):
        case = {
            "meta": json.loads(json.dumps(world["meta"])),
            "commit": dict(world["commit"]),
            "members": dict(world["members"]),
            "redo": rng.random() < 0.85,
        }
        chosen = rng.sample(MUTATIONS, rng.choice([1, 1, 2, 3]))
        for mutation in chosen:
            with contextlib.suppress(IndexError, TypeError, AttributeError):
                mutation(rng, case)
        _write_case(world, root, case, rng)
        label = f"case {i}: {[m.__name__ for m in chosen]}"
        with (
            recorded_paths() as seen,
            warnings.catch_warnings(record=True) as record,
        ):
            warnings.simplefilter("always")
            found = checkpoint.latest(root)
            latest_warnings = list(record)
            del record[:]
            try:
                restored = checkpoint.restore(model, root)["path"]
            except checkpoint.CheckpointMismatchError:
                restored = "mismatch"
        assert found in (newest, older), label
        if found == older:
            outcomes["skipped"] += 1
            assert len(_skips(latest_warnings, newest)) == 1, label
            assert len(_skips(record, newest)) == 1, label
            assert restored == older, label
        elif restored == "mismatch":
            outcomes["mismatch"] += 1
        else:
            outcomes["newest"] += 1
            assert restored == newest, label
            assert not _skips(latest_warnings + record, newest), label
        inside = os.path.realpath(root)
        for path in seen:
            real = os.path.realpath(path)
            if real.startswith(os.path.realpath(base)):
                assert os.path.commonpath([real, inside]) == inside, (
                    f"{label} touched {path}"
                )
    # Each outcome happened (the fuzz reaches every branch).
    assert min(outcomes.values()) > 0, outcomes
    assert outcomes["skipped"] > CASES // 2, outcomes


# -- the defects reported in issue 17, one by one ---------------------------
def _edit(world, root, edit):
    case = {
        "meta": json.loads(json.dumps(world["meta"])),
        "commit": dict(world["commit"]),
        "members": dict(world["members"]),
        "redo": True,
    }
    edit(case)
    _write_case(world, root, case, random.Random(0))


REPORTED = {
    "no files entry": lambda c: c["meta"].pop("files"),
    "invalid JSON": lambda c: c.update(meta_text=lambda s: s[:-5]),
    "object dtype": lambda c: c["meta"]["arrays"][0].update(dtype="object"),
    "file outside": lambda c: c["meta"]["files"].update(
        {"../../outside/secret": {"bytes": 64, "sha256": "0" * 64}}
    ),
    "step differs from name": lambda c: c["meta"].update(step=7),
    "checksum damaged": lambda c: c.update(redo=False, flip=3),
}


@pytest.mark.parametrize("defect", list(REPORTED))
def test_reported_defect_is_skipped_by_latest_and_restore(world, defect):
    root = world["base"] / f"reported-{defect.replace(' ', '_')}"
    _edit(world, root, REPORTED[defect])
    older = str(root / "ckpt-3")
    with recorded_paths() as seen, pytest.warns(UserWarning) as record:
        assert checkpoint.latest(root) == older
        assert checkpoint.restore(world["model"], root)["path"] == older
    skips = _skips(record, root / "ckpt-5")
    assert len(skips) == 2, [str(w.message) for w in record]
    secret = os.path.realpath(world["base"] / "outside" / "secret")
    assert secret not in {os.path.realpath(p) for p in seen}


def test_integers_into_a_float_variable_are_a_mismatch(world):
    root = world["base"] / "kind"
    _edit(world, root, lambda c: m_kind(None, c))
    assert checkpoint.latest(root) == str(root / "ckpt-5")  # a valid file
    with pytest.raises(checkpoint.CheckpointMismatchError) as info:
        checkpoint.restore(world["model"], root)
    assert "dtypes of another kind" in str(info.value)
    assert "kernel (checkpoint int32, model float32)" in str(info.value)
