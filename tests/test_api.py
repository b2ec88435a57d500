"""The public API: names, registry, device names and clear errors."""

import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist._src.devices import normalize_device
from tests.utils import build_model, compile_model, make_data

MULTI = keras.backend.backend() in ("jax", "tensorflow")
needs_multi = pytest.mark.skipif(
    not MULTI, reason="needs simulated devices in one process"
)


def test_public_names():
    for name in keras_dist.__all__:
        assert getattr(keras_dist, name).__doc__, f"{name} has no docstring"


@pytest.mark.parametrize(
    "name, expected",
    [
        ("gpu:0", "gpu:0"),
        ("GPU:1", "gpu:1"),
        ("/device:CPU:3", "cpu:3"),
        ("/job:worker/replica:0/task:1/device:GPU:2", "gpu:2"),
    ],
)
def test_device_names(name, expected):
    assert normalize_device(name) == expected


@pytest.mark.parametrize("name", ["gpu", "cuda:0", "", "cpu:-1", 3])
def test_bad_device_names(name):
    with pytest.raises(ValueError, match="(?i)device"):
        normalize_device(name)


def test_reduce_op_names():
    assert keras_dist.ReduceOp.from_any("sum") is keras_dist.ReduceOp.SUM
    assert keras_dist.ReduceOp.from_any("MEAN") is keras_dist.ReduceOp.MEAN
    with pytest.raises(ValueError, match="ReduceOp"):
        keras_dist.ReduceOp.from_any("max")


def test_registry_and_unknown_name():
    assert "mirrored" in keras_dist.available_strategies()
    with pytest.raises(ValueError, match="Known"):
        keras_dist.strategy_from_name("ring_allreduce")


@needs_multi
def test_registry_aliases_build_strategies():
    strategy = keras_dist.strategy_from_name("dp", devices=["cpu:0", "cpu:1"])
    assert isinstance(strategy, keras_dist.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 2


@needs_multi
def test_default_strategy_outside_scope():
    strategy = keras_dist.get_strategy()
    assert isinstance(strategy, keras_dist.OneDeviceStrategy)
    assert strategy.num_replicas_in_sync == 1
    assert not keras_dist.has_strategy()
    mirrored = keras_dist.MirroredStrategy()
    with mirrored.scope():
        assert keras_dist.get_strategy() is mirrored
        assert keras_dist.has_strategy()
    assert keras_dist.get_strategy() is strategy


@needs_multi
def test_simulated_devices_and_default_devices():
    assert keras_dist.list_devices("cpu") == [f"cpu:{i}" for i in range(4)]
    assert keras_dist.MirroredStrategy().num_replicas_in_sync == 4


@needs_multi
def test_device_that_does_not_exist():
    with pytest.raises(ValueError, match=r"cpu:9.*do not exist.*Available"):
        keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:9"])
    with pytest.raises(ValueError, match="twice"):
        keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:0"])


def test_missing_gpus_point_to_the_builds_and_visibility():
    from keras_dist._src.devices import check_devices_exist

    with pytest.raises(ValueError, match=r"sees no GPU: .*CUDA build"):
        check_devices_exist(["gpu:0"], ["cpu:0"])
    with pytest.raises(ValueError) as info:  # a CPU index past the end
        check_devices_exist(["cpu:3"], ["cpu:0"])
    assert "sees no" not in str(info.value)


@needs_multi
def test_nested_scopes_of_different_strategies():
    a = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    b = keras_dist.MirroredStrategy(devices=["cpu:2", "cpu:3"])
    with a.scope():
        with a.scope():  # re-entering the same strategy is fine
            pass
        with pytest.raises(keras_dist.StrategyMixingError, match="nested"):
            with b.scope():
                pass
    assert not keras_dist.has_strategy()


@needs_multi
def test_model_created_outside_scope_is_refused():
    model = build_model()
    strategy = keras_dist.MirroredStrategy()
    with strategy.scope():
        with pytest.raises(
            keras_dist.VariablesOutsideScopeError, match="outside"
        ):
            compile_model(model)


@needs_multi
def test_model_built_in_scope_but_compiled_outside_is_refused():
    strategy = keras_dist.MirroredStrategy()
    with strategy.scope():
        model = build_model()
    with pytest.raises(keras_dist.StrategyMixingError, match="compile"):
        compile_model(model)


@needs_multi
def test_layer_built_outside_scope_is_refused():
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    strategy = keras_dist.MirroredStrategy()
    with strategy.scope():
        inputs = keras.Input((3,))
        model = keras.Model(inputs, dense(inputs))
        with pytest.raises(keras_dist.VariablesOutsideScopeError):
            model.compile(optimizer="sgd", loss="mse")


@needs_multi
def test_model_cannot_move_to_another_strategy():
    a = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with a.scope():
        model = build_model()
        compile_model(model)
    b = keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with b.scope():
        with pytest.raises(
            (
                keras_dist.StrategyMixingError,
                keras_dist.VariablesOutsideScopeError,
            )
        ):
            compile_model(model)


@needs_multi
def test_model_of_a_multi_device_strategy_names_it_under_one_device():
    # It said "created outside strategy.scope()" on JAX.
    with keras_dist.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = build_model()
    with keras_dist.MirroredStrategy(devices=["cpu:0"]).scope():
        with pytest.raises(
            (
                keras_dist.StrategyMixingError,
                keras_dist.VariablesOutsideScopeError,
            ),
            match="another",
        ):
            compile_model(model)


@needs_multi
def test_simulated_devices_requested_too_late():
    keras.ops.zeros((2,)) + 1  # the backend has started
    with pytest.raises(
        keras_dist.DevicesAlreadyInitializedError, match="before"
    ):
        keras_dist.simulate_cpu_devices(3)
    keras_dist.simulate_cpu_devices(4)  # what it already has: fine
    with pytest.raises(ValueError, match="positive"):
        keras_dist.simulate_cpu_devices(0)


def test_too_late_devices_say_what_to_do_with_and_without_the_variable(
    monkeypatch,
):
    from keras_dist._src.devices import too_late_to_simulate

    monkeypatch.delenv("KERAS_DIST_CPU_DEVICES", raising=False)
    assert "simulate_cpu_devices(3) (or set KERAS_DIST_CPU_DEVICES)" in (
        too_late_to_simulate("JAX", 3)
    )
    # Set, yet too late: setting it is not the fix, importing earlier is.
    monkeypatch.setenv("KERAS_DIST_CPU_DEVICES", "3")
    hint = too_late_to_simulate("JAX", 3)
    assert "KERAS_DIST_CPU_DEVICES=3 is set" in hint
    assert "import keras_dist before anything uses JAX" in hint


@pytest.mark.slow  # a fresh process: 3-5 s
@needs_multi
def test_simulated_devices_from_a_fresh_process(tmp_path):
    code = (
        "import keras_dist\n"
        "keras_dist.simulate_cpu_devices(3)\n"
        "print(keras_dist.MirroredStrategy().num_replicas_in_sync)\n"
    )
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("KERAS_DIST_CPU_DEVICES", "XLA_FLAGS")
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "3"


def test_torch_single_process_strategy_without_devices():
    if keras.backend.backend() != "torch":
        pytest.skip("torch only")
    # Without simulated devices, torch's default is one CPU process.
    assert keras_dist.MirroredStrategy().num_replicas_in_sync == 1


@needs_multi
def test_run_reduce_gather_and_distributed_dataset():
    strategy = keras_dist.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    x = np.arange(10, dtype="float32").reshape(10, 1)
    batches = [b for b in strategy.distribute_dataset([x[:6], x[6:]])]
    assert len(batches) == 2
    seen = []
    for batch in batches:
        parts = strategy.experimental_local_results(batch)
        assert len(parts) == n
        seen.extend(np.concatenate([np.asarray(p) for p in parts]).ravel())
        doubled = strategy.run(lambda t: t * 2.0, args=(batch,))
        total = strategy.reduce(
            "sum",
            strategy.run(lambda t: keras.ops.sum(t), args=(batch,)),
            axis=None,
        )
        np.testing.assert_allclose(
            float(np.asarray(total)), float(np.sum(batch_values(parts)))
        )
        gathered = np.asarray(strategy.gather(doubled, axis=0))
        np.testing.assert_allclose(gathered, 2 * batch_values(parts))
        mean = strategy.reduce(keras_dist.ReduceOp.MEAN, batch, axis=0)
        np.testing.assert_allclose(
            np.asarray(mean), batch_values(parts).mean(0), rtol=1e-6
        )
    assert seen == list(range(10))  # every sample once, in order


@needs_multi
def test_local_results_of_structures_are_one_structure_per_replica():
    """A dict batch and what `run` returns for it split into one dict per
    replica, as tf.distribute's `experimental_local_results` does."""
    strategy = keras_dist.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    x = np.arange(21, dtype="float32").reshape(7, 3)
    (batch,) = strategy.distribute_dataset([{"a": x, "b": x[:, 0]}])
    parts = strategy.experimental_local_results(batch)
    assert len(parts) == n
    assert all(set(part) == {"a", "b"} for part in parts)
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(part["a"]) for part in parts]), x
    )
    sums = strategy.run(
        lambda d: {"a": keras.ops.sum(d["a"]), "b": keras.ops.sum(d["b"])},
        args=(batch,),
    )
    results = strategy.experimental_local_results(sums)
    assert len(results) == n
    np.testing.assert_allclose(
        [float(np.asarray(r["a"])) for r in results],
        [float(np.asarray(part["a"]).sum()) for part in parts],
    )


def batch_values(parts):
    return np.concatenate([np.asarray(p) for p in parts])


@needs_multi
def test_experimental_alias():
    strategy = keras_dist.MirroredStrategy()
    x, _, _ = make_data(8)
    a = list(strategy.experimental_distribute_dataset([x]))
    assert len(a) == 1


def test_non_chief_leaves_out_chief_only_callbacks(tmp_path):
    """What a worker other than the chief passes to Keras: no progress bar,
    no file writers, also inside a user-built CallbackList."""
    from keras_dist._src.keras_glue.callbacks import gate_call_arguments

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    kept = keras.callbacks.EarlyStopping()
    writers = [
        keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras")),
    ]
    for given in (
        [kept, *writers],
        keras.callbacks.CallbackList([kept, *writers], model=model),
    ):
        args, kwargs = gate_call_arguments(
            False, model.fit, (), {"callbacks": given, "verbose": 1}
        )
        got = kwargs["callbacks"]
        got = got.callbacks if hasattr(got, "callbacks") else got
        assert got == [kept]
        assert kwargs["verbose"] == 0
        # The chief's arguments are left as they are.
        assert (
            gate_call_arguments(True, model.fit, (), {"callbacks": given})[1][
                "callbacks"
            ]
            is given
        )


def test_instance_patches_refuse_to_restore_over_another_patch():
    """Two overlapping patchers of one attribute (tf.distribute's replica
    threads): restoring the first would silently undo or leak the second."""
    from keras_dist._src.patching import InstancePatches

    class Thing:
        def call(self):
            return "class"

    thing = Thing()
    first, second = InstancePatches(), InstancePatches()
    first.set(thing, "call", lambda: "first")
    second.set(thing, "call", lambda: "second")
    with pytest.raises(RuntimeError, match="changed while patched"):
        first.restore()
    # The second finds its patch gone too: said, not passed over.
    with pytest.raises(RuntimeError, match=r"\['Thing.call'\]"):
        second.restore()
    # In order (last in, first out), the class's method comes back.
    other = Thing()
    first.set(other, "call", lambda: "first")
    first.restore()
    assert other.call() == "class" and "call" not in other.__dict__


@needs_multi
def test_first_fit_says_what_trains_where_once(capfd):
    # MirroredStrategy said nothing about its devices: a run on one replica
    # looked like a run on four.
    strategy = keras_dist.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((18, 3), "float32")
    capfd.readouterr()
    model.fit(x, x[:, :1], batch_size=10, epochs=1, verbose=0)
    model.fit(x, x[:, :1], batch_size=10, epochs=1, verbose=0)
    model.evaluate(x, x[:, :1], batch_size=10, verbose=0)
    lines = [
        line
        for line in capfd.readouterr().err.splitlines()
        if line.startswith("keras_dist: ")
    ]
    assert lines == [
        f"keras_dist: MirroredStrategy on {keras.backend.backend()}: "
        "4 replicas, 1 process x 4 devices (cpu:0 cpu:1 cpu:2 cpu:3), no "
        "mesh (every variable whole on each replica); fit: per-replica "
        "batch 2-3 (global 10)"
    ]


def test_the_start_line_names_a_sharded_plans_mesh():
    # ShardedDataParallel without a mesh splits its variables over a 1-D
    # mesh of the replicas; the line said "every variable whole".
    import types

    from keras_dist._src import output
    from keras_dist._src import plan as plan_lib

    # As on torch, where the job's size makes the mesh.
    plan = plan_lib.ShardedPlan(
        plan_lib.Topology.MIRRORED, ("cpu:0",), batch_axis="batch", min_size=64
    )
    strategy = types.SimpleNamespace(plan=plan)
    assert output._mesh_text(strategy) == (
        "1-D mesh over the replicas, axis 'batch' (each variable of 64+ "
        "elements split)"
    )


def test_one_replica_found_says_how_to_get_more():
    from keras_dist._src import output

    strategy = keras_dist.MirroredStrategy(["cpu:0"])
    # One device named on purpose: nothing to say.
    assert output.one_replica_advice(strategy, False) is None
    strategy._many_devices_meant = True  # as MirroredStrategy() finding one
    assert output.one_replica_advice(strategy, False) == (
        "MirroredStrategy found one device (cpu:0): training runs on a "
        "single replica, as without a strategy. On a CPU, split it: "
        "KERAS_DIST_CPU_DEVICES=4 (or keras_dist.simulate_cpu_devices(4) "
        "right after `import keras_dist`)."
    )
    assert "keras-dist launch --nproc-per-node 2" in (
        output.one_replica_advice(strategy, True)
    )


def test_verbosity_levels(monkeypatch):
    import logging

    from keras_dist._src import output

    for value, level in (("0", logging.WARNING), ("2", logging.DEBUG)):
        monkeypatch.setenv(output.ENV_VERBOSE, value)
        assert output.verbosity() == level
    monkeypatch.delenv(output.ENV_VERBOSE)
    assert output.verbosity() == logging.INFO
    monkeypatch.setenv(output.ENV_VERBOSE, "yes")
    with pytest.raises(ValueError, match="KERAS_DIST_VERBOSE='yes'"):
        output.verbosity()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_print_and_on_chief_before_a_strategy(monkeypatch, capsys, rank):
    # On torch the script runs once per process: a plain print appears
    # once per rank. Before any strategy, the launcher's variables say who
    # the chief is.
    from keras_dist._src import output

    monkeypatch.setattr(output, "_last_strategy", None)
    for name, value in dict(
        RANK=rank,
        WORLD_SIZE="2",
        LOCAL_RANK=rank,
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29400",
    ).items():
        monkeypatch.setenv(name, value)

    @keras_dist.on_chief
    def summary(value):
        """Returns twice `value`."""
        return 2 * value

    keras_dist.print("epoch", 1, sep=":")
    chief = rank == "0"
    assert capsys.readouterr().out == ("epoch:1\n" if chief else "")
    assert summary(21) == (42 if chief else None)
    assert summary.__doc__ == "Returns twice `value`."
