"""Every private JAX name keras_dist reaches (``jax._src``), by use.

JAX has no public API to ask whether its backends have started, to reach
the coordination service's client (its key-value store) or to bind the
CPU backend's gloo collectives to an address; the functions below reach
into ``jax._src`` for these, one each.
"""

from __future__ import annotations


def backends_initialized() -> bool:
    """Whether JAX's backends (its devices) have started.

    Reaches ``jax._src.xla_bridge.backends_are_initialized`` (or, in
    releases without it, ``xla_bridge._backends``): JAX exposes no public
    check, and ``jax.devices()`` would start the backends.
    """
    from jax._src import xla_bridge

    check = getattr(xla_bridge, "backends_are_initialized", None)
    if check is not None:
        return bool(check())
    return bool(getattr(xla_bridge, "_backends", {}))


def _global_state():
    from jax._src import distributed

    return distributed.global_state


def distributed_client():
    """The client of ``jax.distributed``'s coordination service, or None
    before `jax.distributed.initialize`.

    Reaches ``jax._src.distributed.global_state.client``: the key-value
    store (``key_value_set``, ``blocking_key_value_get``) has no public
    API, and whether the job is joined is known only there.
    """
    return _global_state().client


def coordinator_address() -> str | None:
    """The ``host:port`` of ``jax.distributed``'s coordinator, if joined.

    Reaches ``jax._src.distributed.global_state.coordinator_address``,
    which JAX does not expose publicly (a Cloud TPU job finds it itself).
    """
    return _global_state().coordinator_address


def register_cpu_backend_with_gloo_on(host: str) -> None:
    """Registers JAX's CPU backend again with gloo collectives listening
    on `host` (before the CPU backend starts).

    Reaches ``jax._src.xla_bridge.register_backend_factory`` and
    ``make_cpu_client``, ``jax._src.lib._jax.make_gloo_tcp_collectives``
    and the coordination client: JAX has no setting for the address its
    gloo collectives bind to.

    Raises:
        AttributeError: or TypeError, when this JAX release has other
            names or signatures for these.
    """
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    client = distributed_client()

    def make_cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=client, hostname=host
        )
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory(
        "cpu", make_cpu_client, priority=0, fail_quietly=False
    )


def running_in_cloud_tpu_vm() -> bool:
    """Whether this process runs on a Cloud TPU VM (False where this JAX
    release cannot tell).

    Reaches ``jax._src.cloud_tpu_init.running_in_cloud_tpu_vm``: JAX's own
    test before it joins a TPU slice, with no public equivalent.
    """
    try:
        from jax._src.cloud_tpu_init import running_in_cloud_tpu_vm as found
    except ImportError:  # another JAX release
        return False
    return bool(found)
