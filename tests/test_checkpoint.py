"""keras_dist.checkpoint and BackupAndRestore in one process.

Format on disk, atomicity (partial writes invisible, damaged files
skipped), keep-N, asynchronous saving, clear errors for another model, and
exact resumption of an interrupted `fit` (mid-epoch, shuffled, with
dropout) on the active backend, with and without a strategy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist import checkpoint
from keras_dist._src.checkpoint import format as fmt
from keras_dist.callbacks import PREEMPTION_EXIT_CODE, BackupAndRestore

BACKEND = keras.backend.backend()


def build(seed=3, units=8, dropout=0.3, strategy=None, name=None, eager=False):
    """A small shuffled-and-dropout regression model, compiled (`eager`:
    without compiling the step, for tests of the files only)."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(units, activation="tanh"),
                keras.layers.Dropout(dropout),
                keras.layers.Dense(2),
            ],
            name=name,
        )
        model.compile(
            optimizer="adam", loss="mse", metrics=["mae"], run_eagerly=eager
        )
    return model


def data(n=40):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    return x, y


def values(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def state_of(model):
    return (
        values(model.variables)
        + values(model.optimizer.variables)
        + values(model.metrics_variables)
    )


def assert_same(a, b, rtol=0.0):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=0)


class Crash(keras.callbacks.Callback):
    """Raises after `at` training steps, like a process that dies."""

    def __init__(self, at):
        super().__init__()
        self.at = at
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.at:
            raise RuntimeError("simulated crash")


def trained(tmp_path, epochs=1):
    model = build(eager=True)
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0)
    return model


# -- format and atomicity --
def test_save_writes_a_complete_checkpoint(tmp_path):
    model = trained(tmp_path)
    path = checkpoint.save(model, tmp_path / "ck")
    assert os.path.basename(path) == "ckpt-5"  # 40 samples / 8 = 5 steps
    assert sorted(os.listdir(path)) == ["COMMIT", "arrays.npz", "metadata.json"]
    with open(os.path.join(path, "metadata.json"), "rb") as f:
        raw = f.read()
    meta = json.loads(raw)
    commit = json.loads(open(os.path.join(path, "COMMIT")).read())
    assert commit["metadata_sha256"] == hashlib.sha256(raw).hexdigest()
    digest = hashlib.sha256(
        open(os.path.join(path, "arrays.npz"), "rb").read()
    ).hexdigest()
    assert meta["files"]["arrays.npz"]["sha256"] == digest
    assert meta["versions"]["backend"] == BACKEND
    assert meta["versions"]["keras"] == keras.__version__
    assert meta["versions"]["keras_dist"] == keras_dist.__version__
    assert meta["strategy"]["num_replicas_in_sync"] == 1
    keys = {entry["key"] for entry in meta["arrays"]}
    assert "model/sequential/dense/kernel" in keys
    assert "optimizer/adam/iteration" in keys
    assert "metrics/loss/total" in keys
    assert "rng/numpy/keys" in keys
    # No pickle anywhere: every array loads with allow_pickle=False.
    with np.load(os.path.join(path, "arrays.npz"), allow_pickle=False) as z:
        assert len(z.files) == len(meta["arrays"])
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith(".")]


def test_restore_gives_back_every_variable(tmp_path):
    model = trained(tmp_path)
    checkpoint.save(model, tmp_path / "ck")
    expected = state_of(model)
    other = build(seed=9, eager=True)
    x, y = data()
    other.fit(x[:16], y[:16], batch_size=8, verbose=0)
    meta = checkpoint.restore(other, tmp_path / "ck")
    assert meta["step"] == 5 and meta["path"].endswith("ckpt-5")
    assert_same(state_of(other), expected)


@pytest.mark.multi_device
@pytest.mark.skipif(BACKEND == "torch", reason="one process per device")
def test_restore_into_mirrored_model(tmp_path):
    x, y = data()
    model = build(dropout=0.0)
    model.fit(x, y, batch_size=8, verbose=0)
    checkpoint.save(model, tmp_path / "ck")
    strategy = keras_dist.MirroredStrategy()
    other = build(seed=9, dropout=0.0, strategy=strategy)
    other.fit(x[:16], y[:16], batch_size=8, verbose=0)
    checkpoint.restore(other, tmp_path / "ck")
    assert_same(values(other.variables), values(model.variables))
    assert_same(
        values(other.optimizer.variables), values(model.optimizer.variables)
    )
    # It still trains replicated, from the restored weights.
    other.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert_same(
        values(other.trainable_variables),
        values(model.trainable_variables),
        rtol=1e-5,
    )


def test_keep_last_n(tmp_path):
    model = trained(tmp_path)
    for step in (1, 2, 3, 4):
        checkpoint.save(model, tmp_path / "ck", step=step, keep=2)
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-3", "ckpt-4"]
    assert checkpoint.latest(tmp_path / "ck").endswith("ckpt-4")


def test_partial_writes_are_invisible(tmp_path):
    model = trained(tmp_path)
    root = tmp_path / "ck"
    checkpoint.save(model, root, step=5)
    # What a crash leaves: a temporary directory, and (on a filesystem
    # without atomic rename) a final name without its COMMIT marker.
    checkpoint.save(model, root, step=8)
    os.remove(root / "ckpt-8" / "COMMIT")
    (root / ".ckpt-9.tmp-0123abcd").mkdir()
    (root / ".ckpt-9.tmp-0123abcd" / "arrays.npz").write_bytes(b"PK")
    with pytest.warns(UserWarning) as record:
        assert checkpoint.latest(root).endswith("ckpt-5")
    text = " ".join(str(w.message) for w in record)
    assert ".ckpt-9.tmp-0123abcd" in text and "ckpt-8" in text
    with pytest.warns(UserWarning):
        assert checkpoint.restore(build(), root)["step"] == 5


def test_save_replaces_only_what_it_wrote(tmp_path):
    from keras_dist._src.checkpoint import shards

    model = trained(tmp_path)
    root = tmp_path / "ck"
    # A user's own directory under a checkpoint's name is refused, whole
    # (one file) or sharded, and left as it was.
    (root / "ckpt-5").mkdir(parents=True)
    (root / "ckpt-5" / "my_notes.txt").write_text("mine")
    with pytest.raises(fmt.CheckpointError, match="my_notes.txt"):
        checkpoint.save(model, root, step=5)
    with pytest.raises(fmt.CheckpointError, match="not a keras_dist"):
        shards.begin(str(root), 5)
    assert os.listdir(root / "ckpt-5") == ["my_notes.txt"]
    assert sorted(os.listdir(root)) == ["ckpt-5"]
    # Its own checkpoint, even with its COMMIT gone (an interrupted
    # removal), is replaced; what an interrupted write left is removed.
    checkpoint.save(model, root, step=6)
    os.remove(root / "ckpt-6" / "COMMIT")
    (root / ".ckpt-9.tmp-0123abcd").mkdir()
    (root / ".ckpt-9.tmp-0123abcd" / "shards-00001.json.part").touch()
    (root / "notes.txt").write_text("mine too")
    # A user's directory under a temporary's name holds other files: kept.
    (root / ".ckpt-7.tmp-89abcdef").mkdir()
    (root / ".ckpt-7.tmp-89abcdef" / "mine.txt").write_text("mine")
    checkpoint.save(model, root, step=6)
    assert sorted(os.listdir(root)) == [
        ".ckpt-7.tmp-89abcdef", "ckpt-5", "ckpt-6", "notes.txt"
    ]  # fmt: skip
    assert os.listdir(root / ".ckpt-7.tmp-89abcdef") == ["mine.txt"]
    assert checkpoint.latest(root).endswith("ckpt-6")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_checkpoint_is_skipped(tmp_path, damage):
    model = trained(tmp_path)
    root = tmp_path / "ck"
    checkpoint.save(model, root, step=1)
    expected = state_of(model)
    model.fit(*data(), batch_size=8, verbose=0)
    checkpoint.save(model, root, step=2)
    arrays = root / "ckpt-2" / "arrays.npz"
    raw = bytearray(arrays.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw[len(raw) // 2] ^= 0xFF
    arrays.write_bytes(bytes(raw))
    fresh = build()
    with pytest.warns(UserWarning, match="ckpt-2"):
        meta = checkpoint.restore(fresh, root)
    assert meta["step"] == 1
    assert_same(values(fresh.variables), expected[: len(fresh.variables)])


@pytest.mark.slow
def test_other_model_is_refused_naming_the_variables(tmp_path):
    checkpoint.save(trained(tmp_path), tmp_path / "ck")
    wider = build(units=5, eager=True)
    wider.fit(*data(16), batch_size=8, verbose=0)
    with pytest.raises(checkpoint.CheckpointMismatchError) as info:
        checkpoint.restore(wider, tmp_path / "ck")
    message = str(info.value)
    assert "model/sequential/dense/kernel" in message
    assert "(4, 8)" in message and "(4, 5)" in message

    keras.backend.clear_session()
    deeper = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8),
            keras.layers.Dense(3),
            keras.layers.Dense(2),
        ]
    )
    deeper.compile(optimizer="adam", loss="mse")
    with pytest.raises(checkpoint.CheckpointMismatchError) as info:
        checkpoint.restore(deeper, tmp_path / "ck")
    assert "missing from the checkpoint" in str(info.value)
    assert "dense_2/kernel" in str(info.value)


def test_renamed_but_identical_model_matches_in_order(tmp_path):
    model = trained(tmp_path)
    checkpoint.save(model, tmp_path / "ck")
    renamed = build(name="renamed")
    with pytest.warns(UserWarning, match="in order"):
        checkpoint.restore(renamed, tmp_path / "ck")
    assert_same(values(renamed.variables), values(model.variables))


def test_unbuilt_model_gets_a_clear_error(tmp_path):
    checkpoint.save(trained(tmp_path), tmp_path / "ck")
    keras.backend.clear_session()
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="not built"):
        checkpoint.restore(unbuilt, tmp_path / "ck")


def test_missing_checkpoint_raises(tmp_path):
    with pytest.raises(checkpoint.CheckpointNotFoundError):
        checkpoint.restore(trained(tmp_path), tmp_path / "nothing")
    assert checkpoint.latest(tmp_path / "nothing") is None


def test_async_save_copies_then_writes(tmp_path):
    model = trained(tmp_path)
    expected = state_of(model)
    path = checkpoint.save(model, tmp_path / "ck", async_save=True)
    # Training goes on while the write is in flight; the checkpoint holds
    # the state at the time of the save.
    model.fit(*data(), batch_size=8, verbose=0)
    checkpoint.wait()
    assert checkpoint.latest(tmp_path / "ck") == path
    fresh = build()
    checkpoint.restore(fresh, tmp_path / "ck")
    assert_same(values(fresh.variables), expected[: len(fresh.variables)])


def test_rng_states_are_restored(tmp_path):
    model = trained(tmp_path)
    import random

    # torch's too on every backend: a torch DataLoader's shuffle draws
    # from it whatever the backend.
    torch = pytest.importorskip("torch")
    checkpoint.save(model, tmp_path / "ck")
    expected = (random.random(), np.random.random(), float(torch.rand(())))
    checkpoint.restore(model, tmp_path / "ck")
    got = (random.random(), np.random.random(), float(torch.rand(())))
    assert got == expected


# -- BackupAndRestore --
def fit(model, callbacks, epochs=2, **kwargs):
    x, y = data()
    return model.fit(
        x,
        y,
        batch_size=8,
        epochs=epochs,
        shuffle=True,
        verbose=0,
        callbacks=callbacks,
        **kwargs,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "crash_at, save_freq, spe",
    [
        pytest.param(7, 2, 1, id="mid-epoch"),
        pytest.param(8, "epoch", 1, id="epoch"),
        pytest.param(
            8,
            3,
            2,
            id="steps_per_execution",
            marks=pytest.mark.skipif(
                BACKEND == "torch", reason="Keras on torch runs 1 step a call"
            ),
        ),
    ],
)
def test_interrupted_fit_resumes_exactly(tmp_path, crash_at, save_freq, spe):
    backup = str(tmp_path / "backup")
    reference = build()
    reference.compile(
        optimizer="adam", loss="mse", metrics=["mae"], steps_per_execution=spe
    )
    history = fit(reference, [])
    expected = values(reference.variables)

    model = build()
    model.compile(
        optimizer="adam", loss="mse", metrics=["mae"], steps_per_execution=spe
    )
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(
            model,
            [
                BackupAndRestore(backup, save_freq=save_freq),
                Crash(crash_at // spe),
            ],
        )
    assert checkpoint.latest(backup) is not None

    model = build()
    model.compile(
        optimizer="adam", loss="mse", metrics=["mae"], steps_per_execution=spe
    )
    callback = BackupAndRestore(backup, save_freq=save_freq)
    resumed = fit(model, [callback])
    assert callback.restored_from is not None
    assert_same(values(model.variables), expected, rtol=1e-6)
    # The resumed epochs' logs (metrics restored mid-epoch) are the same.
    n = len(resumed.history["loss"])
    np.testing.assert_allclose(
        resumed.history["loss"], history.history["loss"][-n:], rtol=1e-6
    )
    assert not os.path.exists(backup)  # removed once training finished


def test_resume_keeps_early_stopping_and_lr_plateau_state(tmp_path):
    """EarlyStopping and ReduceLROnPlateau count epochs without progress;
    a resumed run continues their counts (and EarlyStopping's best
    weights) instead of starting afresh, and stops when the uninterrupted
    run stops, with its learning rate. The backup, listed first, is saved
    once every callback has seen the epoch's end."""

    def others():
        # No epoch improves the loss by 10: EarlyStopping stops after epoch
        # 2, the learning rate halves after every epoch but the first.
        return [
            keras.callbacks.EarlyStopping(
                "loss", min_delta=10, patience=2, restore_best_weights=True
            ),
            keras.callbacks.ReduceLROnPlateau(
                "loss", factor=0.5, patience=1, min_delta=10
            ),
        ]

    reference = build()
    history = fit(reference, others(), epochs=6)
    assert len(history.history["loss"]) == 3
    backup = str(tmp_path / "backup")
    model = build()
    with pytest.raises(RuntimeError, match="simulated crash"):
        # 5 steps an epoch: the crash is in epoch 2, the backup of epoch 1.
        fit(model, [BackupAndRestore(backup), *others(), Crash(12)], epochs=6)
    model = build()
    resumed = fit(model, [BackupAndRestore(backup), *others()], epochs=6)
    assert len(resumed.history["loss"]) == 1  # epoch 2, then it stopped
    assert float(model.optimizer.learning_rate) == float(
        reference.optimizer.learning_rate
    )
    assert_same(values(model.variables), values(reference.variables), 1e-6)


@pytest.mark.parametrize(
    "source",
    [
        "tf.data",
        pytest.param(
            "tf.data mirrored",
            marks=[
                pytest.mark.multi_device,
                pytest.mark.skipif(
                    BACKEND == "torch", reason="one process per device"
                ),
            ],
        ),
        "DataLoader",
    ],
)
def test_interrupted_fit_on_a_reshuffled_input_resumes_exactly(
    tmp_path, source
):
    """Inputs that shuffle from random state of their own. A `tf.data`
    shuffle draws a new order for each iterator made of it (Keras makes
    one or two an epoch): the resumed run makes as many as the
    interrupted one had made before the resumed epoch. A torch
    `DataLoader` with a `generator=` of its own draws from that: its state
    at the epoch's start is restored. Either way the resumed epoch's order
    and the weights are the uninterrupted run's (without it the resumed
    epoch took the first epoch's order: 1e-3 apart)."""
    mirrored = source.endswith("mirrored")
    strategy = keras_dist.MirroredStrategy() if mirrored else None

    def run(callbacks):
        model = build(strategy=strategy)
        if source == "DataLoader":
            torch = pytest.importorskip("torch")
            x, y = data()
            inputs = torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(
                    torch.from_numpy(x), torch.from_numpy(y)
                ),
                batch_size=8,
                shuffle=True,
                generator=torch.Generator().manual_seed(5),
            )
        else:
            tf = pytest.importorskip("tensorflow")
            inputs = tf.data.Dataset.from_tensor_slices(data()).shuffle(40)
            if mirrored:  # no known length: Keras counts the batches itself
                inputs = inputs.filter(lambda x, y: True)
            inputs = inputs.batch(8)
        model.fit(inputs, epochs=3, verbose=0, callbacks=callbacks)
        return model

    expected = values(run([]).variables)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="simulated crash"):
        # 5 steps an epoch: the crash after step 3 of the 3rd epoch.
        run([BackupAndRestore(backup, save_freq=2), Crash(13)])
    callback = BackupAndRestore(backup, save_freq=2)
    model = run([callback])
    assert callback.restored_from.endswith("ckpt-12")
    assert_same(values(model.variables), expected, rtol=1e-6)


@pytest.mark.multi_device
@pytest.mark.skipif(BACKEND == "torch", reason="one process per device")
def test_interrupted_mirrored_fit_resumes_exactly(tmp_path):
    backup = str(tmp_path / "backup")
    strategy = keras_dist.MirroredStrategy()
    reference = build(strategy=strategy)
    fit(reference, [])
    model = build(strategy=strategy)
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(model, [BackupAndRestore(backup, save_freq=3), Crash(7)])
    model = build(strategy=strategy)
    fit(model, [BackupAndRestore(backup, save_freq=4)])
    assert_same(values(model.variables), values(reference.variables), rtol=1e-6)


@pytest.mark.slow
def test_signal_stops_fit_after_saving(tmp_path):
    backup = str(tmp_path / "backup")
    before = signal.getsignal(signal.SIGUSR1)

    class Signal(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                os.kill(os.getpid(), signal.SIGUSR1)

    callback = BackupAndRestore(
        backup,
        save_freq=False,
        preemption_signals=(signal.SIGUSR1,),
        exit_on_preemption=False,
    )
    model = build()
    fit(model, [callback, Signal()])
    assert callback.preempted
    # Acted on once every callback has seen the step the signal came in
    # (the third), even though `Signal` runs after BackupAndRestore.
    assert checkpoint.latest(backup).endswith("ckpt-3")
    meta = json.loads(
        open(os.path.join(checkpoint.latest(backup), "metadata.json")).read()
    )
    position = dict(meta["position"])
    # Keras 3.16's array adapter counts epochs to draw its shuffle: the
    # count as of the saved epoch's start (`input_replay`).
    inputs = position.pop("input_iterators", None)
    assert inputs is None or len(inputs["adapter_epochs"]) == 1
    assert position == {
        "epoch": 0,
        "step_in_epoch": 3,
        "global_step": 3,
        "steps_per_epoch": 5,
    }
    assert signal.getsignal(signal.SIGUSR1) == before
    assert PREEMPTION_EXIT_CODE == 75


def test_failed_fit_does_not_swallow_signals(tmp_path):
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: received.append(s))
    try:
        with pytest.raises(RuntimeError):
            fit(
                build(),
                [
                    BackupAndRestore(
                        str(tmp_path / "b"),
                        preemption_signals=(signal.SIGUSR1,),
                    ),
                    Crash(2),
                ],
            )
        # fit raised, so on_train_end never ran: a later signal must reach
        # the handler that was there before.
        os.kill(os.getpid(), signal.SIGUSR1)
        assert received == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore(str(tmp_path), save_freq=0)
    with pytest.raises(ValueError, match="backup_dir"):
        BackupAndRestore("")


# -- BackupAndRestore owns only what it wrote (issue 17) ---------------------
def test_backup_refuses_a_directory_with_a_users_checkpoint(tmp_path):
    root = tmp_path / "mine"
    user = trained(tmp_path)
    saved = checkpoint.save(user, root, step=1000)
    (root / "notes.txt").write_text("mine")
    before = sorted(os.listdir(root))
    model = build()
    weights = values(model.variables)
    with pytest.raises(ValueError, match="did not write") as info:
        fit(model, [BackupAndRestore(str(root))], epochs=1)
    assert "ckpt-1000" in str(info.value)
    assert sorted(os.listdir(root)) == before  # nothing deleted or added
    assert checkpoint.latest(root) == saved
    assert_same(values(model.variables), weights)  # nothing was restored


def test_backup_deletes_only_its_own_files(tmp_path):
    root = tmp_path / "backup"

    class Intruder(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            (root / "user.txt").write_text("not the callback's")

    backup = BackupAndRestore(str(root))
    fit(build(), [backup, Intruder()], epochs=1)
    # Its checkpoint and marker are gone; the user's file and so the
    # directory stay.
    assert sorted(os.listdir(root)) == ["user.txt"]
    # A marked directory whose files came after the claim (a preempted
    # run's ModelCheckpoint writing there): it resumes, names them, leaves
    # them. (It refused, and a requeued job could not resume.)
    (root / "user.txt").unlink()

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("crash in epoch 2")

    with pytest.raises(RuntimeError, match="crash"):
        fit(build(), [BackupAndRestore(str(root)), Crash()], epochs=2)
    (root / "other.bin").write_bytes(b"x")
    seen = []
    began = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: seen.append(epoch)
    )
    fit(build(), [BackupAndRestore(str(root)), began], epochs=2)
    assert seen == [1]  # resumed after the backed-up epoch
    assert sorted(os.listdir(root)) == ["other.bin"]
    assert (root / "other.bin").read_bytes() == b"x"


# -- preemption at every position (issue 17) ---------------------------------
class Events(keras.callbacks.Callback):
    """Records what callbacks see: batches, epochs, optimizer steps."""

    def __init__(self):
        super().__init__()
        self.batches, self.epochs = [], []

    def _step(self):
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((batch, self._step()))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((epoch, self._step()))
        self.epochs.append(
            [float(logs[k]) for k in ("loss", "mae", "val_loss")]
        )


class Preempt(keras.callbacks.Callback):
    """Sends SIGUSR1 to this process before call `at` of the train
    function, or before the first validation batch."""

    def __init__(self, at=None):
        super().__init__()
        self.at, self.calls, self.in_validation = at, 0, at is None

    def on_train_batch_begin(self, batch, logs=None):
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGUSR1)
        self.calls += 1

    def on_test_batch_begin(self, batch, logs=None):
        if self.in_validation:
            self.in_validation = False
            os.kill(os.getpid(), signal.SIGUSR1)


_REFERENCES = {}


def preemption_fit(model, callbacks, spe):
    x, y = data()
    model.compile(
        optimizer="adam", loss="mse", metrics=["mae"], steps_per_execution=spe
    )
    return model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=True,
        verbose=0,
        validation_data=(x[:16], y[:16]),
        callbacks=callbacks,
    )


def _reference(spe):
    if spe not in _REFERENCES:
        model, events = build(), Events()
        preemption_fit(model, [events], spe)
        _REFERENCES[spe] = events, values(model.variables)
    return _REFERENCES[spe]


_SLOW = pytest.mark.slow
_NO_TORCH_SPE = pytest.mark.skipif(
    BACKEND == "torch", reason="Keras on torch runs 1 step a call"
)


@pytest.mark.parametrize(
    "at, spe, saved, where",
    [
        pytest.param(
            0, 1, 1, "at epoch 1, step 1 of 5", id="first-step", marks=_SLOW
        ),
        pytest.param(
            2, 1, 3, "at epoch 1, step 3 of 5", id="mid-epoch", marks=_SLOW
        ),
        pytest.param(4, 1, 5, "at epoch 1, step 5 of 5", id="epoch-end"),
        pytest.param(
            9, 1, 10, "at epoch 2, step 5 of 5", id="run-end", marks=_SLOW
        ),
        pytest.param(
            None, 1, 5, "after epoch 1 of 2", id="validation", marks=_SLOW
        ),
        pytest.param(
            2,
            2,
            5,
            "at epoch 1, step 5 of 5",
            id="steps_per_execution",
            marks=[_NO_TORCH_SPE, _SLOW],
        ),
    ],
)
def test_preemption_at_every_position(tmp_path, capsys, at, spe, saved, where):
    """Preempted at `at`, resumed: callbacks see each trained step once,
    the checkpoint is named after the optimizer's step, the message gives
    the true epoch, and the weights are those of an uninterrupted run."""
    reference, expected = _reference(spe)
    backup = str(tmp_path / "backup")
    first = Events()

    def backup_callback():
        return BackupAndRestore(
            backup, save_freq=False, preemption_signals=(signal.SIGUSR1,)
        )

    with pytest.raises(SystemExit) as info:
        preemption_fit(build(), [Preempt(at), backup_callback(), first], spe)
    assert info.value.code == PREEMPTION_EXIT_CODE
    message = capsys.readouterr().err
    assert f"{where} (global step {saved})" in message, message
    path = checkpoint.latest(backup)
    assert os.path.basename(path) == f"ckpt-{saved}"
    arrays = fmt.load_arrays(path, fmt.read_metadata(path))
    (iteration,) = [
        v
        for k, v in arrays.items()
        if re.match(r"optimizer/[^/]+/iteration$", k)
    ]
    assert int(iteration) == saved
    assert first.batches[-1][1] == saved  # every callback saw that step

    model, second = build(), Events()
    callback = backup_callback()
    preemption_fit(model, [callback, second], spe)
    assert callback.restored_from == path
    assert first.batches + second.batches == reference.batches
    steps = [e for e in first.epochs + second.epochs if isinstance(e, tuple)]
    assert steps == [e for e in reference.epochs if isinstance(e, tuple)]
    logs = [e for e in first.epochs + second.epochs if isinstance(e, list)]
    np.testing.assert_allclose(
        logs, [e for e in reference.epochs if isinstance(e, list)], rtol=1e-6
    )
    assert_same(values(model.variables), expected, rtol=1e-6)
    assert not os.path.exists(backup)


# -- sharded checkpoints (format 2) --
def _sharded_entries(rank, overlap=False):
    """Rank 0 owns rows 0-2 of a 4x6 array and the whole bias; rank 1
    rows 2-4 (or, with `overlap`, rows 0-2 again)."""
    w = np.arange(24, dtype="float32").reshape(4, 6)
    rows = slice(0, 2) if rank == 0 or overlap else slice(2, 4)
    entries = [
        {
            "key": "model/w",
            "shape": [4, 6],
            "layout": ["model", None],
            "pieces": [((rows.start, 0), w[rows].copy())],
        },
        {
            "key": "model/b",
            "shape": [3],
            "pieces": [((0,), np.ones(3, "int32"))] if rank == 0 else [],
        },
    ]
    return w, entries


@pytest.mark.fast
def test_sharded_checkpoint_commits_and_reads_any_region(tmp_path):
    from keras_dist._src.checkpoint import shards

    root = str(tmp_path / "ck")
    token = shards.begin(root, 7)
    temp = shards.temp_path(root, 7, token)
    for rank in (1, 0):
        w, entries = _sharded_entries(rank)
        shards.write_own(temp, rank, entries)
    path = shards.commit(root, 7, token, 2, {"step": 7})
    assert sorted(os.listdir(root)) == ["ckpt-7"]
    assert sorted(os.listdir(path)) == [
        "COMMIT",
        "metadata.json",
        "shards-00000.npz",
        "shards-00001.npz",
    ]
    metadata = fmt.verify(path)
    (entry, bias) = metadata["arrays"]
    assert entry["layout"] == ["model", None] and "layout" not in bias
    assert [(p["file"], p["start"]) for p in entry["pieces"]] == [
        ("shards-00000.npz", [0, 0]),
        ("shards-00001.npz", [2, 0]),
    ]
    arrays = fmt.open_arrays(path, metadata)
    saved = arrays["model/w"]
    assert saved.shape == (4, 6) and saved.dtype == np.float32
    # Any region, across the two files: another layout's part.
    np.testing.assert_array_equal(
        saved.read((slice(1, 3), slice(2, 5))), w[1:3, 2:5]
    )
    np.testing.assert_array_equal(np.asarray(saved), w)
    np.testing.assert_array_equal(np.asarray(arrays["model/b"]), np.ones(3))
    arrays.close()
    # A damaged shard file is skipped, naming it.
    shard = os.path.join(path, "shards-00001.npz")
    raw = bytearray(open(shard, "rb").read())
    raw[-200] ^= 0xFF
    open(shard, "wb").write(bytes(raw))
    with pytest.warns(UserWarning, match="shards-00001.npz"):
        assert checkpoint.latest(root) is None


@pytest.mark.fast
def test_sharded_commit_refuses_what_is_not_complete(tmp_path):
    from keras_dist._src.checkpoint import shards

    root = str(tmp_path / "ck")
    # Two processes writing the same rows: the pieces do not cover.
    token = shards.begin(root, 1)
    for rank in (0, 1):
        shards.write_own(
            shards.temp_path(root, 1, token),
            rank,
            _sharded_entries(rank, overlap=True)[1],
        )
    with pytest.raises(fmt.CheckpointError, match="disagree on which"):
        shards.commit(root, 1, token, 2, {"step": 1})
    # A process that failed is named.
    token = shards.begin(root, 2)
    temp = shards.temp_path(root, 2, token)
    shards.write_own(temp, 0, _sharded_entries(0)[1])
    shards.write_failure(temp, 1, "OSError: disk full")
    with pytest.raises(fmt.CheckpointError, match="Process 1 .*disk full"):
        shards.commit(root, 2, token, 2, {"step": 2})
    # A process that never writes: the chief gives up, naming it.
    token = shards.begin(root, 3)
    shards.write_own(shards.temp_path(root, 3, token), 0, [])
    with pytest.raises(fmt.CheckpointError, match=r"Processes \[1\]"):
        shards.commit(root, 3, token, 2, {"step": 3}, timeout=0.1)
    # Nothing visible, nothing left behind.
    assert os.listdir(root) == []


def _committed_sharded(root):
    from keras_dist._src.checkpoint import shards

    token = shards.begin(root, 4)
    for rank in (0, 1):
        temp = shards.temp_path(root, 4, token)
        shards.write_own(temp, rank, _sharded_entries(rank)[1])
    return shards.commit(root, 4, token, 2, {"step": 4})


def _piece(meta, i=0):
    return meta["arrays"][0]["pieces"][i]


SHARDED_DEFECTS = {
    "piece outside": lambda m: _piece(m).update(start=[3, 0]),
    "piece in an unlisted file": lambda m: _piece(m).update(file="x.npz"),
    "overlapping pieces": lambda m: _piece(m, 1).update(start=[1, 0]),
    "member name": lambda m: _piece(m).update(name="../a0"),
    "file outside": lambda m: m["files"].update(
        {"../../secret": {"bytes": 1, "sha256": "0" * 64}}
    ),
    "no pieces": lambda m: m["arrays"][0].pop("pieces"),
    "object dtype": lambda m: m["arrays"][0].update(dtype="object"),
    "wrong piece shape": lambda m: _piece(m).update(shape=[2, 5]),
}


@pytest.mark.fast
@pytest.mark.parametrize("defect", list(SHARDED_DEFECTS))
def test_sharded_metadata_is_validated(tmp_path, defect):
    """A hand-edited sharded metadata (checksum redone) is invalid: a
    `CheckpointCorruptError` naming it, never another exception."""
    root = str(tmp_path / "ck")
    path = _committed_sharded(root)
    meta_path = os.path.join(path, "metadata.json")
    meta = json.loads(open(meta_path).read())
    SHARDED_DEFECTS[defect](meta)
    data = json.dumps(meta).encode()
    open(meta_path, "wb").write(data)
    commit = json.loads(open(os.path.join(path, "COMMIT")).read())
    commit["metadata_sha256"] = hashlib.sha256(data).hexdigest()
    open(os.path.join(path, "COMMIT"), "w").write(json.dumps(commit))
    with pytest.raises(fmt.CheckpointCorruptError, match="invalid"):
        fmt.verify(path)
    with pytest.warns(UserWarning, match="Skipping checkpoint"):
        assert checkpoint.latest(root) is None


def test_a_process_that_cannot_see_the_directory_says_so(tmp_path):
    """Another host's process whose checkpoint path is not on a shared
    filesystem does not find the chief's temporary directory: a clear
    error, and nothing written."""
    from keras_dist._src.checkpoint import shards
    from keras_dist._src.checkpoint.format import CheckpointError

    missing = tmp_path / ".ckpt-1.tmp-abcd"
    entry = {"key": "w", "shape": [2], "dtype": "float32", "pieces": []}
    with pytest.raises(CheckpointError, match="filesystem every process"):
        shards.write_own(str(missing), 1, [entry])
    assert list(tmp_path.iterdir()) == []
