"""Where keras_dist meets Keras internals: the compile hook and private APIs.

Known to work with the Keras versions in `SUPPORTED_KERAS` (tested in CI).
"""
