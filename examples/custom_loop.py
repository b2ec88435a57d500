"""A custom training loop under MirroredStrategy, equal to `model.fit`.

TensorFlow: a `tf.GradientTape` step run on every replica with
`strategy.run`; the optimizer all-reduces the gradients. JAX: `jax.grad` of
Keras's stateless call on every replica's shard, gradients summed with
`strategy.reduce`. Each replica's loss is its *sum* over its samples divided
by the global batch size, so the summed gradient is that of the global mean
(what `fit` computes), also for a last batch that does not divide evenly.
(On PyTorch, see examples/custom_loop_torch.py.)

    KERAS_BACKEND=jax python examples/custom_loop.py
"""

import os

os.environ.setdefault("KERAS_DIST_CPU_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # noqa: E402  (before the backend starts computing)

BATCH, EPOCHS, LEARNING_RATE = 16, 3, 0.1


def build_model():
    """Conv2D + Dense classifier (no BatchNormalization: see
    guides/distributed_training.md, "Custom training loops")."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def make_data(n=90):
    """Random images and labels (90 = 5 batches of 16 and one of 10)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    return x, y


def global_batches(x, y):
    """The global batches, in order (what `fit(shuffle=False)` sees)."""
    return [
        (x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)
    ]


def per_sample_loss(y, y_pred):
    """Cross-entropy of every sample (no reduction)."""
    return keras.losses.sparse_categorical_crossentropy(y, y_pred)


def train_tensorflow(strategy, model, optimizer, x, y):
    """GradientTape on every replica; apply_gradients all-reduces."""
    import tensorflow as tf

    @tf.function
    def step(batch, global_size):
        def replica_step(x_part, y_part):
            with tf.GradientTape() as tape:
                y_pred = model(x_part, training=True)
                loss = tf.reduce_sum(per_sample_loss(y_part, y_pred))
                loss = loss / global_size
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = strategy.run(replica_step, args=batch)
        return strategy.reduce("sum", losses)

    for epoch in range(EPOCHS):
        batches = global_batches(x, y)
        dataset = tf.data.Dataset.from_generator(
            lambda b=batches: iter(b),
            output_signature=(
                tf.TensorSpec((None, 8, 8, 1), "float32"),
                tf.TensorSpec((None,), "int32"),
            ),
        )
        for (batch_x, _), batch in zip(
            batches, strategy.distribute_dataset(dataset)
        ):
            loss = step(batch, tf.constant(len(batch_x), "float32"))
        last = float(loss)
        keras_dist.print(f"epoch {epoch + 1}: last batch loss {last:.4f}")


def train_jax(strategy, model, optimizer, x, y):
    """jax.grad on every replica's shard; gradients summed across them."""
    import jax

    def loss_fn(trainable, non_trainable, x_part, y_part, global_size):
        y_pred, non_trainable = model.stateless_call(
            trainable, non_trainable, x_part, training=True
        )
        loss = per_sample_loss(y_part, y_pred).sum() / global_size
        return loss, non_trainable

    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))

    def replica_step(trainable, non_trainable, x_part, y_part, size):
        (loss, _), grads = grad_fn(
            trainable, non_trainable, x_part, y_part, size
        )
        return loss, grads

    for epoch in range(EPOCHS):
        for batch_x, batch_y in global_batches(x, y):
            trainable = [v.value for v in model.trainable_variables]
            non_trainable = [v.value for v in model.non_trainable_variables]
            (batch,) = strategy.distribute_dataset([(batch_x, batch_y)])

            # Plain values (the variables, the global batch size) are
            # mirrored: every replica gets them; per-replica ones are split.
            losses, grads = strategy.run(
                replica_step,
                args=(trainable, non_trainable, *batch, len(batch_x)),
            )
            grads = strategy.reduce("sum", grads)
            loss = strategy.reduce("sum", losses)
            optimizer.apply(grads, model.trainable_variables)
        last = float(loss)
        keras_dist.print(f"epoch {epoch + 1}: last batch loss {last:.4f}")


def train_custom(strategy, x, y):
    """Builds the model in the scope and trains it with the custom loop."""
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(LEARNING_RATE)
        optimizer.build(model.trainable_variables)
    if keras.backend.backend() == "tensorflow":
        train_tensorflow(strategy, model, optimizer, x, y)
    else:
        train_jax(strategy, model, optimizer, x, y)
    return model


def train_fit(strategy, x, y):
    """The same training with `model.fit`."""
    with strategy.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.SGD(LEARNING_RATE),
            loss="sparse_categorical_crossentropy",
        )
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model


def main():
    """Trains both ways and prints how far apart the weights are."""
    if keras.backend.backend() not in ("jax", "tensorflow"):
        raise SystemExit(
            "Run with KERAS_BACKEND=jax or tensorflow (torch: "
            "examples/custom_loop_torch.py)."
        )
    strategy = keras_dist.MirroredStrategy()
    x, y = make_data()
    custom = train_custom(strategy, x, y)
    fitted = train_fit(strategy, x, y)
    worst = max(
        float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))
        for a, b in zip(custom.get_weights(), fitted.get_weights())
    )
    keras_dist.print(
        f"max relative weight difference, custom loop vs fit: {worst:.2e}"
    )


if __name__ == "__main__":
    main()
