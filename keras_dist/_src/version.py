"""The one version string of keras_dist.

``pyproject.toml`` reads it (``[tool.setuptools.dynamic]``), and
``keras_dist.__version__`` and checkpoint metadata import it from here, so
the installed package, the import and saved checkpoints always agree.
"""

__version__ = "0.3.0"
