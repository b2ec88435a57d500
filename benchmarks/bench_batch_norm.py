"""One BatchNormalization layer's training forward and backward on torch.

Times, interleaved on the same inputs in one process (one thread, no
collective: one rank), the three ways a training step can normalise:

* ``keras``: Keras's own layer code (its moments, then its
  `batch_normalization` op), under autograd;
* ``moments``: keras_dist's synchronised moments (`local_gathered_moments`,
  a hand-written moments backward) followed by Keras's op under autograd:
  what a synchronised layer took before the fused function;
* ``fused``: `_SyncNormalization`, moments and Keras's normalisation in one
  autograd function with the analytic backward (what a synchronised
  layer runs now in a training forward).

Shapes are the BatchNormalization inputs of `bench_torch.py`'s models
(batch 64, channels last). Prints the median milliseconds of forward plus
backward per shape and the ratios to ``keras``. Run::

    KERAS_BACKEND=torch python benchmarks/bench_batch_norm.py [--repeats 25]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("OMP_NUM_THREADS", "1")

SHAPES = [(64, 32, 32, 16), (64, 32, 32, 32), (64, 16, 16, 64)]


def _ways():
    from keras import ops

    from keras_dist._src.backends.torch.batch_norm import (
        _SyncNormalization,
        local_gathered_moments,
    )

    def keras_way(x, gamma, beta):
        mean, variance = ops.moments(x, axes=[0, 1, 2])
        return ops.batch_normalization(
            x, mean, variance, axis=-1, offset=beta, scale=gamma, epsilon=1e-3
        )

    def moments_way(x, gamma, beta):
        mean, variance = local_gathered_moments(x, [0, 1, 2], lambda t: t[None])
        return ops.batch_normalization(
            x, mean, variance, axis=-1, offset=beta, scale=gamma, epsilon=1e-3
        )

    def fused_way(x, gamma, beta):
        return _SyncNormalization.apply(x, gamma, beta, 1e-3, None, 1, 1.0)[0]

    return {"keras": keras_way, "moments": moments_way, "fused": fused_way}


def main():
    """Prints forward + backward milliseconds per way and shape."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    import numpy as np
    import torch

    torch.set_num_threads(1)
    ways = _ways()
    for shape in SHAPES:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=generator) * 3 + 1
        upstream = torch.randn(shape, generator=generator)
        gamma = torch.nn.Parameter(torch.rand(shape[-1]) + 0.5)
        beta = torch.nn.Parameter(torch.randn(shape[-1]))
        times = {name: [] for name in ways}
        # 3 untimed rounds first: the allocator's first large blocks of a
        # shape are page faults (glibc raises its mmap threshold after).
        for repeat in range(3 + args.repeats):
            for name, way in ways.items():
                inputs = x.detach().requires_grad_()
                gamma.grad = beta.grad = None
                start = time.perf_counter()
                way(inputs, gamma, beta).backward(upstream)
                if repeat >= 3:
                    times[name].append(time.perf_counter() - start)
        medians = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
        cells = ", ".join(
            f"{k} {ms:.1f} ms ({ms / medians['keras']:.2f})"
            for k, ms in medians.items()
        )
        print(f"{shape}: {cells}")


if __name__ == "__main__":
    main()
