"""What `keras-dist doctor` checks on JAX: the framework's versions and
one all-reduce over the devices `MirroredStrategy()` would use."""

from __future__ import annotations

from keras_dist._src.devices import sum_over


def framework_versions() -> dict:
    """The versions of JAX's packages."""
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def all_reduce_check(devices: list[str]) -> tuple[float, float, str]:
    """Sum of 1..N over an array sharded on a `Mesh` of `devices`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    by_name = {}
    for device in jax.devices():
        by_name[f"{device.platform}:{device.id}"] = device
    if jax.default_backend() != "cpu":
        for device in jax.devices("cpu"):
            by_name.setdefault(f"cpu:{device.id}", device)
    mesh = Mesh(np.array([by_name[d] for d in devices]), ("replica",))
    values = np.arange(1, len(devices) + 1, dtype="float32")
    sharded = jax.device_put(
        values, NamedSharding(mesh, PartitionSpec("replica"))
    )
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))
    result = total(sharded)
    shards = {float(s.data) for s in result.addressable_shards}
    if len(shards) != 1:
        raise RuntimeError(f"the devices disagree on the sum: {shards}")
    return (float(result), *sum_over(devices))
