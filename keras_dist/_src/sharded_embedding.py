"""`ShardedEmbedding`: an embedding table split by rows.

Under `ParameterServerStrategy` (TensorFlow) the table is built as one
variable per shard (by default one per ps task; the strategy places
consecutive variables on consecutive ps tasks), and a lookup gathers only
the rows it needs from each shard (`tf.nn.embedding_lookup` over the list,
rows split into contiguous blocks, as its "div" strategy does): the
gradient is an `IndexedSlices` per shard, and only those rows travel and
are updated. No `variable_partitioner` is needed (Keras's train_step cannot
differentiate the `ShardedVariable` a partitioner makes).

Everywhere else (JAX, torch, other strategies) it is Keras's `Embedding`
with one ``embeddings`` variable, which `ModelParallel` row-shards with a
layout map entry such as ``layout_map[".*embeddings"] = ("model", None)``:
the same model file runs on every backend.
"""

from __future__ import annotations

import keras

from keras_dist._src.keras_glue.internals import variable_value


def _shards(requested) -> int:
    """Shards of the table: `requested` (or one per ps task) under
    ParameterServerStrategy (TensorFlow's only: the one strategy with
    `num_ps`), else 1 (one variable)."""
    from keras_dist._src.context import current_strategy

    num_ps = getattr(current_strategy(), "num_ps", None)
    if not num_ps:
        return 1
    return int(requested or num_ps)


def shard_rows(rows: int, shards: int) -> list[int]:
    """Rows of each shard: contiguous blocks, the first ``rows % shards``
    one row longer (`tf.nn.embedding_lookup`'s "div" split)."""
    base, extra = divmod(rows, shards)
    return [base + (1 if i < extra else 0) for i in range(shards)]


@keras.saving.register_keras_serializable(package="keras_dist")
class ShardedEmbedding(keras.layers.Embedding):
    """Keras's `Embedding`, its rows sharded over the ps tasks under
    `ParameterServerStrategy` (module doc).

    Args:
        input_dim: vocabulary size (rows).
        output_dim: embedding size.
        num_shards: shards of the table under ParameterServerStrategy;
            None for one per ps task. Ignored elsewhere (one variable).
            The shards start as the rows of one draw of the whole table,
            as a plain `Embedding` with the same initializer starts.
        **kwargs: `keras.layers.Embedding`'s other arguments (LoRA and
            quantization are not supported when sharded).
    """

    def __init__(self, input_dim, output_dim, num_shards=None, **kwargs):
        self.num_shards = num_shards
        self._shards = None
        super().__init__(input_dim, output_dim, **kwargs)

    def build(self, input_shape=None):
        """Creates the table: one variable, or `num_shards` row shards
        under `ParameterServerStrategy`."""
        if self.built:
            return
        shards = max(1, min(_shards(self.num_shards), int(self.input_dim)))
        if shards == 1:
            return super().build(input_shape)
        if self.lora_rank or self.quantization_mode:
            raise ValueError(
                "ShardedEmbedding with several shards supports neither LoRA "
                "nor quantization."
            )
        # One draw of the whole table, as a plain Embedding's, split by rows:
        # the shards start as one device's table would (a seeded initializer
        # called once per shard gave every shard the same rows).
        table = self.embeddings_initializer(
            (self.input_dim, self.output_dim), dtype=self.variable_dtype
        )
        self._shards = []
        start = 0
        for i, rows in enumerate(shard_rows(self.input_dim, shards)):
            part = table[start : start + rows]
            start += rows
            self._shards.append(
                self.add_weight(
                    shape=(rows, self.output_dim),
                    initializer=lambda shape, dtype=None, part=part: part,
                    name=f"embeddings_{i}",
                    regularizer=self.embeddings_regularizer,
                    constraint=self.embeddings_constraint,
                    trainable=True,
                )
            )
        self.built = True

    @property
    def embeddings(self):
        """The whole table (the shards concatenated when sharded)."""
        if self._shards is None:
            return super().embeddings
        return keras.ops.concatenate(self._shards, axis=0)

    def call(self, inputs):
        """Looks up `inputs` (integer ids) in the table or its shards."""
        if self._shards is None:
            return super().call(inputs)
        import tensorflow as tf

        ids = tf.cast(inputs, "int64")
        params = [variable_value(s) for s in self._shards]
        return tf.nn.embedding_lookup(params, ids)

    def get_config(self):
        """`Embedding`'s config with `num_shards`."""
        config = super().get_config()
        config["num_shards"] = self.num_shards
        return config
