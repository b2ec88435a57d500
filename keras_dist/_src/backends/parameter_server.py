"""ParameterServerStrategy where no backend engine exists (JAX, torch)."""

from __future__ import annotations

from keras_dist._src.errors import UnsupportedBackendError


def unsupported_engine(plan, runtime, input_options):
    """Raises: JAX and torch have no asynchronous parameter-server engine.

    Raises:
        UnsupportedBackendError: always, naming what to use instead.
    """
    del plan, runtime, input_options
    from keras_dist._src.backends import name

    raise UnsupportedBackendError(
        "ParameterServerStrategy runs on the TensorFlow backend only: "
        f"the {name()} backend has no asynchronous parameter-server engine "
        "(workers updating variables held by ps tasks). Run the script "
        "with KERAS_BACKEND=tensorflow, or, for large embedding tables, "
        "use keras_dist.ModelParallel with the tables row-sharded "
        "(keras_dist.layers.ShardedEmbedding, or a LayoutMap entry "
        "`layout_map['.*embeddings'] = ('model', None)`), which trains "
        "synchronously and equals one device."
    )
