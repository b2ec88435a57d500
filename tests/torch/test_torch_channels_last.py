"""Keras's channels-last convolutions and pooling through a permuted view
(`keras_dist._src.backends.torch.channels_last`), against Keras's own
layers on one device: the same outputs (bits), the same gradients but for
the rounding of a sum over a gradient now in the other memory order (a
bias after a pooling layer: 1 ulp here), and no transposing copy of the
activations. One process, no ranks (the 2-rank
parity tests run the same path in `fit`)."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("needs KERAS_BACKEND=torch", allow_module_level=True)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from keras_dist._src.backends.torch import channels_last  # noqa: E402

L = keras.layers


class _OwnConv(L.Conv2D):
    """A subclass with its own convolution: left alone."""

    def convolution_op(self, inputs, kernel):
        return super().convolution_op(inputs, kernel) * 0.5


def _model():
    image = keras.Input((13, 12, 6))
    h = L.Conv2D(8, 3, strides=2, padding="same", activation="relu")(image)
    h = L.Conv2D(8, 3, dilation_rate=2, groups=2, padding="same")(h)
    h = L.MaxPooling2D(3, strides=2, padding="same")(h)  # overlapping
    h = L.AveragePooling2D(2, padding="valid")(h)
    h = _OwnConv(4, 1)(h)
    volume = keras.Input((6, 7, 5, 3))
    v = L.Conv3D(4, 3, padding="same", use_bias=False)(volume)
    v = L.MaxPooling3D(2)(v)
    v = L.AveragePooling3D(2, strides=1, padding="same")(v)
    sequence = keras.Input((9, 3))
    s = L.MaxPooling1D(2)(L.Conv1D(4, 3)(sequence))  # 1D: left alone
    out = L.Concatenate()([L.Flatten()(h), L.Flatten()(v), L.Flatten()(s)])
    return keras.Model([image, volume, sequence], L.Dense(3)(out))


class _Copies(TorchDispatchMode):
    """Counts the copies of a tensor of at least `size` elements."""

    def __init__(self, size):
        super().__init__()
        self.size, self.count = size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("clone", "copy_") and args[0].numel() >= self.size:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _step(model, inputs):
    """Outputs and every gradient (inputs' and weights') of one backward."""
    tensors = [torch.tensor(x, requires_grad=True) for x in inputs]
    out = model(tensors, training=True)
    (out * out).sum().backward()
    weights = [v.value for v in model.trainable_variables]
    grads = [t.grad for t in tensors] + [w.grad for w in weights]
    return out.detach(), grads


def test_keras_results_without_layout_copies():
    keras.utils.set_random_seed(3)
    reference = _model()
    model = keras.models.clone_model(reference)
    model.set_weights(reference.get_weights())
    assert channels_last.install(model.layers) == 7
    assert channels_last.install(model.layers) == 0
    rng = np.random.default_rng(0)
    inputs = [
        rng.normal(size=(5, 13, 12, 6)).astype("float32"),
        rng.normal(size=(5, 6, 7, 5, 3)).astype("float32"),
        rng.normal(size=(5, 9, 3)).astype("float32"),
    ]
    want, want_grads = _step(reference, inputs)
    got, grads = _step(model, inputs)
    assert torch.equal(got, want)
    names = ["input"] * len(inputs)
    names += [v.path for v in model.trainable_variables]
    assert len(grads) == len(want_grads) == len(names)
    for name, a, b in zip(names, grads, want_grads):
        if name.endswith("bias"):  # may round in its last bit
            scale = float(b.abs().max())
            assert float((a - b).abs().max()) <= 1e-6 * scale, name
        else:  # inputs' and kernels' gradients: the same bits
            assert torch.equal(a, b), name
    # The mechanism: a conv + pooling stack on a contiguous channels-last
    # activation copies nothing of its size (Keras's own path: 2 copies a
    # convolution, 1 a pooling).
    x = torch.tensor(rng.normal(size=(4, 16, 16, 8)).astype("float32"))
    stack = [L.Conv2D(8, 3, padding="same"), L.MaxPooling2D(2)]
    stack[0].build(x.shape)
    counts = []
    for install in (False, True):
        if install:
            channels_last.install(stack)
        with _Copies(x.numel() // 4) as copies:
            stack[1](stack[0](x))
        counts.append(copies.count)
    assert counts == [3, 0]
