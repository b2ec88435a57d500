"""Layers of keras_dist (`ShardedEmbedding`)."""

from keras_dist._src.sharded_embedding import ShardedEmbedding

__all__ = ["ShardedEmbedding"]
