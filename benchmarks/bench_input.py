"""Input-to-step time with distribution on and off, for the same data.

Measures what it costs to get each global batch from the input pipeline to
where the step can use it, without the step itself:

* ``off``: Keras's own epoch iterator over the data, each batch placed on
  one device — what `fit` does without keras_dist;
* ``on``: the same iterator with keras_dist's handling of each batch —
  JAX: split along the batch axis over the N-device mesh
  (``MirroredEngine.place_batch``); TensorFlow: keras_dist's exact split of
  every global batch into per-replica parts over N devices (the distributed
  dataset `fit` iterates).

* ``anchor``: the backend's own distribution of the same batches over the
  same N devices — JAX: what `keras.distribution.DataParallel` does
  (``jax.make_array_from_process_local_data``); TensorFlow:
  ``tf.distribute.MirroredStrategy.experimental_distribute_dataset``.

All run side by side in one process, interleaved over ``--repeats``; the
table shows the median time per batch, ``on/off - 1`` (the extra cost of
distribution; target <= 2 %) and ``on/anchor``.

    KERAS_BACKEND=jax python benchmarks/bench_input.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ANCHORS = {
    "jax": "make_array_from_process_local_data",
    "tensorflow": "tf.distribute",
}


def main() -> int:
    """Runs the benchmark for the backend in ``KERAS_BACKEND``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--features", type=int, default=784)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    os.environ.setdefault("KERAS_DIST_CPU_DEVICES", str(args.devices))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    import keras
    import numpy as np
    from keras.src.trainers.epoch_iterator import EpochIterator

    import keras_dist

    backend = keras.backend.backend()
    if backend not in ("jax", "tensorflow"):
        print("bench_input: run with KERAS_BACKEND=jax or tensorflow")
        return 2
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, args.features)).astype("float32")
    y = rng.integers(0, 10, args.samples).astype("int32")
    strategy = keras_dist.MirroredStrategy()
    engine = strategy.extended

    def batches():
        iterator = EpochIterator(x=x, y=y, batch_size=args.batch_size)
        if backend == "jax":
            return iterator.data_adapter.get_jax_iterator()
        return iterator.data_adapter.get_tf_dataset()

    if backend == "jax":
        import jax

        device = jax.devices()[0]

        def place(mode, batch):
            if mode == "on":
                return engine.place_batch(batch)
            if mode == "anchor":
                return jax.tree.map(
                    lambda t: jax.make_array_from_process_local_data(
                        engine.sharded, t
                    ),
                    batch,
                )
            return jax.device_put(batch, device)

        def run(mode: str) -> float:
            start = time.perf_counter()
            count = 0
            for batch in batches():
                jax.block_until_ready(place(mode, batch))
                count += 1
            return (time.perf_counter() - start) / count

    else:
        import tensorflow as tf

        def run(on: bool) -> float:
            dataset = batches()
            if on:
                with strategy.scope():
                    dataset = (
                        engine.tf_strategy.experimental_distribute_dataset(
                            dataset
                        )
                    )
            start = time.perf_counter()
            count = 0
            with tf.device("/device:CPU:0"):
                for batch in dataset:
                    for part in tf.nest.flatten(batch):
                        for value in engine.local_results(part):
                            value.numpy()  # wait until it is there
                    count += 1
            return (time.perf_counter() - start) / count

    modes = ("off", "on", "anchor")
    for mode in modes:  # warm up
        run(mode)
    times = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode in modes:
            times[mode].append(run(mode))
    median = {mode: statistics.median(times[mode]) * 1e3 for mode in modes}
    paired = [b / a for a, b in zip(times["off"], times["on"])]
    print(
        f"backend={backend} devices={strategy.num_replicas_in_sync} "
        f"batch={args.batch_size}x{args.features} float32"
    )
    print(f"distribution off      : {median['off']:8.3f} ms/batch")
    print(f"distribution on       : {median['on']:8.3f} ms/batch")
    print(f"anchor ({ANCHORS[backend]}): {median['anchor']:8.3f} ms/batch")
    print(
        f"on/off - 1: {median['on'] / median['off'] - 1:+.1%} (median of "
        f"paired ratios {statistics.median(paired) - 1:+.1%}; target <= +2%)"
    )
    print(f"on/anchor : {median['on'] / median['anchor']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
