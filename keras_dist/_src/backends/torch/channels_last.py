"""Keras's channels-last convolutions and pooling on torch, without copies.

Keras's torch ops read a ``channels_last`` input (``N, H, W, C``) by
permuting it to torch's ``N, C, H, W`` order and making that contiguous: a
copy that transposes the whole activation. A 2D or 3D convolution then
copies it back into torch's ``channels_last`` memory format, which its
kernels use; the output is a permuted view. So each convolution and
pooling layer of a channels-last model moves its input twice (pooling
once), and in the backward pass the elementwise ops (ReLU's, BatchNorm's)
meet one gradient in each memory order, which on a CPU costs several
times a same-order pass. On `bench_torch.py`'s ``pooled`` model, one
process, that was 0.29 of Keras's step.

The permuted *view* of a contiguous channels-last tensor already has
torch's ``channels_last`` strides. Given that view as
``data_format="channels_first"``, Keras's own op runs the same torch
kernel on the same memory without the copies, and its output, permuted
back, is contiguous channels-last. Outputs are the same bits as Keras's
``channels_last`` path, and so are the gradients of inputs and kernels;
a sum over a gradient that now arrives in the other memory order (a
convolution's bias before a pooling layer) may round differently in the
last bit (on CPU, for every stride, padding, dilation and group count the
unit test tries).

`install` gives each of a model's Keras `Conv2D`/`Conv3D` (not a
subclass with its own ``convolution_op``) and `MaxPooling2D`/`3D`,
`AveragePooling2D`/`3D` (not a subclass with its own ``call``) this path,
on the instance. 1D layers are left as they are: torch has no
channels-last memory format for them, so Keras's one copy would only
move into torch's kernel. Depthwise, separable and transposed
convolutions keep Keras's path too (their layers' ``call`` holds the op).
"""

from __future__ import annotations

import keras

_CONVOLUTIONS = (keras.layers.Conv2D, keras.layers.Conv3D)
_POOLINGS = (
    keras.layers.MaxPooling2D,
    keras.layers.MaxPooling3D,
    keras.layers.AveragePooling2D,
    keras.layers.AveragePooling3D,
)


def _orders(ndim):
    """The permutation from channels-last to channels-first of an `ndim`
    tensor, and back."""
    return (0, ndim - 1, *range(1, ndim - 1)), (0, *range(2, ndim), 1)


def _channels_last(layer) -> bool:
    """Whether `layer` reads channels-last input."""
    return getattr(layer, "data_format", None) == "channels_last"


def convolution_op(layer):
    """`layer.convolution_op(inputs, kernel)` through the permuted view."""
    first, last = _orders(layer.rank + 2)

    def call(inputs, kernel):
        outputs = keras.ops.conv(
            keras.ops.transpose(inputs, first),
            kernel,
            strides=list(layer.strides),
            padding=layer.padding,
            dilation_rate=layer.dilation_rate,
            data_format="channels_first",
        )
        return keras.ops.transpose(outputs, last)

    return call


def pooling_call(layer):
    """`layer.call(inputs)` of a Keras pooling layer through the permuted
    view."""
    if layer.pool_mode == "max":
        op = keras.ops.max_pool
    else:
        op = keras.ops.average_pool
    first, last = _orders(len(layer.pool_size) + 2)

    def call(inputs):
        outputs = op(
            keras.ops.transpose(inputs, first),
            pool_size=layer.pool_size,
            strides=layer.strides,
            padding=layer.padding,
            data_format="channels_first",
        )
        return keras.ops.transpose(outputs, last)

    return call


def install(layers) -> int:
    """Gives each Keras channels-last 2D/3D convolution and pooling layer
    of `layers` the copy-free path (on the instance, as a method of the
    same name); returns how many it changed. Idempotent."""
    count = 0
    for layer in layers:
        if not _channels_last(layer):
            continue
        kind, own = type(layer), vars(layer)
        if isinstance(layer, _CONVOLUTIONS):
            name, make = "convolution_op", convolution_op
            keras_method = keras.layers.Conv2D.convolution_op
        elif isinstance(layer, _POOLINGS):
            name, make = "call", pooling_call
            keras_method = keras.layers.MaxPooling2D.call
        else:
            continue
        if getattr(kind, name) is not keras_method or name in own:
            continue  # a subclass's own method, or replaced already
        own[name] = make(layer)
        count += 1
    return count
