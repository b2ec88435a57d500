"""What `keras-dist doctor` checks on TensorFlow: the framework's versions and
one all-reduce over the devices `MirroredStrategy()` would use."""

from __future__ import annotations

from keras_dist._src.devices import sum_over


def framework_versions() -> dict:
    """TensorFlow's version."""
    import tensorflow as tf

    return {"tensorflow": tf.__version__}


def all_reduce_check(devices: list[str]) -> tuple[float, float, str]:
    """A replica-context all-reduce under `tf.distribute.MirroredStrategy`."""
    import tensorflow as tf

    names = []
    for device in devices:
        kind, index = device.split(":")
        names.append(f"/device:{kind.upper()}:{index}")
    strategy = tf.distribute.MirroredStrategy(names)

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            own = tf.cast(context.replica_id_in_sync_group + 1, tf.float32)
            return context.all_reduce(tf.distribute.ReduceOp.SUM, own)

        return strategy.run(replica_fn)

    results = {
        float(v.numpy()) for v in strategy.experimental_local_results(step())
    }
    if len(results) != 1:
        raise RuntimeError(f"the replicas disagree on the sum: {results}")
    return (results.pop(), *sum_over(devices))
