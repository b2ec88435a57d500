"""Internals of keras_dist. Nothing here is public API; see `keras_dist`."""
