"""The one BatchNormalization moments formula (`core.batch_norm`), unit level.

It runs on every backend through `keras.ops`; the all-reduce is the identity
here (one replica), so what is checked is the formula itself: two passes,
weights, dtypes. Global-batch parity with several replicas is checked by the
parity and feature-matrix tests.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_dist._src.core.batch_norm import global_moments

pytestmark = pytest.mark.fast


def _identity(value):
    return value


def test_variance_is_stable_when_the_mean_dwarfs_the_spread():
    rng = np.random.default_rng(0)
    x = (1e4 + rng.standard_normal((256, 3))).astype("float32")
    mean, variance = global_moments(ops.convert_to_tensor(x), [0], _identity)
    expected = np.var(x.astype("float64"), axis=0)
    np.testing.assert_allclose(ops.convert_to_numpy(variance), expected, 1e-3)
    np.testing.assert_allclose(
        ops.convert_to_numpy(mean), x.astype("float64").mean(0), 1e-6
    )
    # What one pass (E[x^2] - E[x]^2) gives in float32: far off.
    one_pass = np.mean(x * x, 0) - np.square(np.mean(x, 0))
    assert np.max(np.abs(one_pass - expected) / expected) > 0.1


def test_weights_leave_samples_out_and_empty_gives_zero():
    x = np.arange(24, dtype="float32").reshape(6, 2, 2)
    weight = np.array([1, 1, 1, 0, 0, 0], "float32").reshape(6, 1, 1)
    mean, variance = global_moments(
        ops.convert_to_tensor(x),
        [0, 1],
        _identity,
        ops.convert_to_tensor(weight),
    )
    kept = x[:3].reshape(-1, 2)
    np.testing.assert_allclose(ops.convert_to_numpy(mean), kept.mean(0), 1e-6)
    np.testing.assert_allclose(
        ops.convert_to_numpy(variance), kept.var(0), 1e-5
    )
    mean, variance = global_moments(
        ops.convert_to_tensor(x), [0], _identity, 0.0
    )
    assert not np.any(ops.convert_to_numpy(mean))
    assert not np.any(ops.convert_to_numpy(variance))


def test_low_precision_input_keeps_its_dtype():
    x = ops.convert_to_tensor(np.linspace(-2, 2, 32).reshape(16, 2), "float16")
    mean, variance = global_moments(x, [0], _identity)
    assert ops.convert_to_numpy(mean).dtype == np.float16
    assert ops.convert_to_numpy(variance).dtype == np.float16
    np.testing.assert_allclose(
        ops.convert_to_numpy(variance).astype("float32"),
        np.var(np.linspace(-2, 2, 32).reshape(16, 2), 0),
        rtol=2e-3,
    )


def test_combined_moments_of_unequal_parts_equal_the_whole():
    """`gathered_moments`'s combination of per-replica (count, mean, M2):
    unequal parts, one empty, a mean that dwarfs the spread."""
    from keras_dist._src.core.batch_norm import combine_moments

    rng = np.random.default_rng(1)
    x = (1e4 + rng.standard_normal((96, 3))).astype("float32")
    parts = [x[:50], x[50:51], x[51:51], x[51:]]
    stats = []
    for part in parts:
        mean, variance = global_moments(
            ops.convert_to_tensor(part), [0], _identity
        )
        n = np.full(3, len(part), "float32")
        m2 = ops.convert_to_numpy(variance) * len(part)
        stats.append((n, ops.convert_to_numpy(mean), m2))
    counts, means, m2s = (np.stack(s) for s in zip(*stats))
    mean, variance = combine_moments(
        *(ops.convert_to_tensor(v) for v in (counts, means, m2s))
    )
    whole = x.astype("float64")
    np.testing.assert_allclose(ops.convert_to_numpy(mean), whole.mean(0), 1e-6)
    np.testing.assert_allclose(
        ops.convert_to_numpy(variance), whole.var(0), 1e-3
    )


def test_gathered_moments_on_one_replica_match_the_two_pass_formula():
    from keras_dist._src.core.batch_norm import gathered_moments

    rng = np.random.default_rng(2)
    x = ops.convert_to_tensor(
        (1e4 + rng.standard_normal((8, 4, 4, 3))).astype("float32")
    )
    weight = ops.convert_to_tensor(
        np.array([1, 1, 0, 1, 1, 1, 0, 1], "float32").reshape(8, 1, 1, 1)
    )
    for w in (None, weight):
        expected = global_moments(x, [0, 1, 2], _identity, w)
        got = gathered_moments(x, [0, 1, 2], lambda v: v[None], w)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(
                ops.convert_to_numpy(a), ops.convert_to_numpy(b), 1e-4
            )


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch only")
@pytest.mark.parametrize(
    "shape,axes,offset",
    [
        ((8, 5, 5, 3), [0, 1, 2], 0.0),
        ((8, 5, 5, 3), [0, 1, 2], 1e4),  # the mean dwarfs the spread
        ((6, 4), [0], 1e4),
        ((4, 3, 5, 5), [0, 2, 3], 0.0),  # channels first: not a 2-D view
        ((0, 4, 4, 3), [0, 1, 2], 0.0),  # an empty shard
    ],
)
def test_torch_local_moments_match_autograd_of_the_formula(shape, axes, offset):
    """torch's `_LocalMoments` (hand-written backward) gives the values and
    input gradients of `gathered_moments` under autograd, through Keras's
    normalisation."""
    import torch

    from keras_dist._src.keras_glue.internals import torch_ops_module

    torch_nn = torch_ops_module("nn")

    from keras_dist._src.backends.torch.batch_norm import (
        _LocalMoments,
        local_gathered_moments,
    )
    from keras_dist._src.core.batch_norm import gathered_moments

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=generator) + offset).requires_grad_()
    upstream = torch.randn(shape, generator=generator)
    channel_axis = 1 if axes == [0, 2, 3] else -1
    results = []
    for moments in (gathered_moments, local_gathered_moments):
        mean, variance = moments(x, axes, lambda v: v[None])
        y = torch_nn.batch_normalization(x, mean, variance, channel_axis)
        (y * upstream).sum().backward()
        results.append((mean.detach(), variance.detach(), x.grad))
        x.grad = None
    for expected, got in zip(*results):
        scale = float(expected.abs().max()) if expected.numel() else 1.0
        np.testing.assert_allclose(
            got.numpy(), expected.numpy(), rtol=0, atol=1e-6 * scale
        )
    if x.numel():
        x64 = x.detach().double()[:3].requires_grad_()
        assert torch.autograd.gradcheck(
            lambda t: _LocalMoments.apply(t, tuple(axes))[:2], (x64,)
        )


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch only")
@pytest.mark.parametrize(
    "shape,offset",
    [((8, 5, 5, 3), 0.0), ((8, 5, 5, 3), 1e4), ((6, 4), 1e4), ((0, 3), 0.0)],
)
def test_torch_fused_normalization_matches_keras_under_autograd(shape, offset):
    """torch's `_SyncNormalization` (moments, normalisation and an analytic
    backward in one function) gives the outputs, moments and gradients of
    `local_gathered_moments` followed by Keras's own normalisation under
    autograd; and the layer's replaced call takes it in training, keeps the
    moving statistics Keras's call keeps and leaves inference to Keras."""
    import torch

    from keras_dist._src.keras_glue.internals import torch_ops_module

    torch_nn = torch_ops_module("nn")

    from keras_dist._src.backends.torch.batch_norm import (
        _SyncNormalization,
        local_gathered_moments,
        sync_call,
    )
    from keras_dist._src.backends.torch.step_context import (
        StepContext,
        StepSlot,
    )
    from keras_dist._src.keras_glue import internals as glue

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=generator) + offset).requires_grad_()
    upstream = torch.randn(shape, generator=generator)
    channels = shape[-1]
    gamma = (torch.rand(channels, generator=generator) + 0.5).requires_grad_()
    beta = torch.randn(channels, generator=generator).requires_grad_()

    def keras_way():
        mean, variance = local_gathered_moments(
            x, list(range(len(shape) - 1)), lambda v: v[None]
        )
        y = torch_nn.batch_normalization(x, mean, variance, -1, beta, gamma)
        return y, mean, variance

    def fused():
        return _SyncNormalization.apply(x, gamma, beta, 1e-3, None, 1, 1.0)

    def exact():  # the textbook formula, float64
        x64, gamma64, beta64 = (t.double() for t in (x, gamma, beta))
        axes = tuple(range(len(shape) - 1))
        mean = x64.mean(axes)
        variance = (x64 - mean).square().mean(axes)
        y = (x64 - mean) * torch.rsqrt(variance + 1e-3) * gamma64 + beta64
        return y, mean, variance

    results = []
    for way in (keras_way, fused, exact):
        y, mean, variance = way()
        (y * upstream.to(y.dtype)).sum().backward()
        grads = [
            t.grad if t.grad is not None else torch.zeros_like(t)
            for t in (x, gamma, beta)
        ]
        results.append(
            [t.detach().double() for t in (y, mean, variance, *grads)]
        )
        for t in (x, gamma, beta):
            t.grad = None
    # The same moments; outputs and gradients as close to float64's as
    # Keras's own way gets in float32 (an offset of 1e4 costs both ~1e-5).
    if not x.numel():  # an empty shard: no float64 moments to compare to
        results[2] = results[0]
    for keras_value, got, truth in zip(*results):
        scale = np.max(np.abs(truth.numpy()), initial=1.0)
        keras_error = np.max(np.abs((keras_value - truth).numpy()), initial=0)
        error = np.max(np.abs((got - truth).numpy()), initial=0)
        assert error <= 1.5 * keras_error + 1e-6 * scale, (error, keras_error)
    for a, b in zip(results[0][1:3], results[1][1:3]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    if not x.numel():
        return  # Keras's own layer gives NaN statistics for an empty batch
    # The layer: Keras's call against the replaced one, same weights.
    reference = keras.layers.BatchNormalization(momentum=0.8)
    layer = keras.layers.BatchNormalization(momentum=0.8)
    # Keras's one-pass moments lose the 1e4 offset; compare without it.
    inputs = x.detach() - offset
    for bn in (reference, layer):
        bn.build(shape)
        bn.gamma.assign(gamma.detach())
        bn.beta.assign(beta.detach())
    slot = StepSlot()
    glue.replace_batch_norm_call(
        layer,
        sync_call(None, 1, slot, layer, glue.original_batch_norm_call(layer)),
    )
    with slot.training_forward(StepContext(shape[0], shape[0])):
        got = layer(inputs, training=True)
    assert type(got.grad_fn).__name__ == "_SyncNormalizationBackward"
    expected = reference(inputs, training=True)
    np.testing.assert_allclose(
        got.detach().numpy(), expected.detach().numpy(), rtol=0, atol=1e-5
    )
    for a, b in zip(
        layer.non_trainable_weights, reference.non_trainable_weights
    ):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-6)
    # Outside a training forward of the step, Keras's call runs.
    np.testing.assert_allclose(
        layer(inputs, training=False).detach().numpy(),
        reference(inputs, training=False).detach().numpy(),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch only")
def test_torch_combined_moments_are_the_formula_bit_for_bit():
    """torch's own `combine_moments` gives the bits and gradients of the
    formula's Keras ops, with ranks that have no sample among them."""
    import torch

    from keras_dist._src.backends.torch import batch_norm as torch_bn
    from keras_dist._src.core import batch_norm as core_bn

    rng = np.random.default_rng(3)
    counts = rng.integers(0, 5, (3, 7)).astype("float32")
    counts[:, 0] = 0  # a channel no rank has a sample of
    counts[1] = 0  # a rank with an empty shard
    means = (1e3 + rng.standard_normal((3, 7))).astype("float32")
    m2s = rng.uniform(0, 4, (3, 7)).astype("float32")
    results = []
    for combine in (core_bn.combine_moments, torch_bn.combine_moments):
        tensors = [
            torch.tensor(a, requires_grad=True) for a in (counts, means, m2s)
        ]
        mean, variance = combine(*tensors, torch.float16)
        (mean.float().sum() + 3 * variance.float().sum()).backward()
        results.append([mean, variance] + [t.grad for t in tensors])
    for keras_value, torch_value in zip(*results, strict=True):
        assert keras_value.dtype == torch_value.dtype
        assert torch.equal(keras_value, torch_value)


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch only")
def test_torch_one_rank_job_averages_no_moving_statistics():
    """`sync_batch_norm=False` in a one-rank job (a one-GPU machine): the
    moving statistics stay as the step left them and no collective runs
    (here there is no process group at all: one would raise)."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from keras_dist._src.backends.torch.batch_norm import (
        average_moving_statistics,
    )

    assert not dist.is_initialized()
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.BatchNormalization()]
    )
    model(np.ones((4, 3), "float32"), training=True)
    before = [v.value.clone() for v in model.non_trainable_variables]
    engine = SimpleNamespace(
        world_size=1, aux_group=None, device=torch.device("cpu")
    )
    average_moving_statistics(engine, model, SimpleNamespace(n_local=4))
    for value, variable in zip(before, model.non_trainable_variables):
        assert torch.equal(value, variable.value)
