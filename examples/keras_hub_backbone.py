"""A KerasHub backbone under ModelParallel, with KerasHub's own layout map.

A tiny `keras_hub.models.GemmaBackbone` (2 layers, width 16, random
weights: nothing is downloaded) in a `GemmaCausalLM`, laid out over a
("batch", "model") mesh of 4 devices by `GemmaBackbone.get_layout_map`,
passed to `keras_dist.ModelParallel` unchanged. Trains a few steps on
seeded random token ids and prints how many variables were split and the
loss, once. JAX: 4 simulated CPU devices; torch: the strategy starts 4
processes by re-running this script. Needs keras-hub (``pip install
keras-hub``); without it the script says so and exits.

    KERAS_BACKEND=jax python examples/keras_hub_backbone.py
    KERAS_BACKEND=torch python examples/keras_hub_backbone.py
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # noqa: E402  (before the backend starts computing)

if keras.backend.backend() not in ("jax", "torch"):
    print(
        f"skipped: ModelParallel runs on JAX and torch, not "
        f"{keras.backend.backend()} (set KERAS_BACKEND=jax or torch)"
    )
    sys.exit(0)
try:
    import keras_hub
except ImportError:
    print("skipped: pip install keras-hub")
    sys.exit(0)
keras_dist.simulate_cpu_devices(4)  # CPU: 4 devices (torch: 4 processes)

VOCAB, LENGTH = 64, 8


def main():
    """Lays the backbone out with its own map, trains and prints."""
    # KerasHub takes only Keras's own DeviceMesh: build it over
    # keras_dist's device names (the same line on JAX and torch).
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ("batch", "model"), devices=keras_dist.list_devices()[:4]
    )
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    strategy = keras_dist.ModelParallel(layout_map, batch_dim_name="batch")

    keras.utils.set_random_seed(0)
    with strategy.scope():
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=VOCAB,
            num_layers=2,
            num_query_heads=2,
            num_key_value_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            head_dim=8,
        )
        lm = keras_hub.models.GemmaCausalLM(
            backbone=backbone, preprocessor=None
        )
        lm.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    rng = np.random.default_rng(0)  # the same data on every process
    tokens = rng.integers(1, VOCAB, (64, LENGTH + 1)).astype("int32")
    x = {
        "token_ids": tokens[:, :-1],
        "padding_mask": np.ones((64, LENGTH), "bool"),
    }
    history = lm.fit(x, tokens[:, 1:], batch_size=16, epochs=2, verbose=0)
    rows = strategy.describe(lm, print_fn=None)
    split = sum(any(r["layout"]) for r in rows if r["path"] in paths(lm))
    strategy.print(f"split {split} of {len(lm.weights)} model variables")
    losses = ", ".join(f"{v:.4f}" for v in history.history["loss"])
    strategy.print(f"GemmaCausalLM 2x2: losses per epoch {losses}")


def paths(model):
    """The model's own variables' paths (not the optimizer's)."""
    return {v.path for v in model.weights}


if __name__ == "__main__":
    main()
