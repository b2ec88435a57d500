"""Where keras_dist meets Keras internals: the compile hook and private APIs.

keras_dist replaces Keras's step functions and reads some private trainer
state, so it is tied to the Keras releases it was tested with
(`SUPPORTED_KERAS`, the range `pyproject.toml` allows, tested in CI). Any
other release gets one warning at import.
"""

from __future__ import annotations

import warnings

#: Keras minor releases keras_dist is tested with (CI runs the newest).
SUPPORTED_KERAS = ("3.15", "3.16")


def check_keras_version(version: str | None = None) -> bool:
    """Warns once if `version` (default: the installed Keras) is untested.

    Returns:
        Whether the version is one keras_dist is tested with.
    """
    if version is None:
        import keras

        version = keras.__version__
    minor = ".".join(version.split(".")[:2])
    if minor in SUPPORTED_KERAS:
        return True
    warnings.warn(
        f"keras_dist {_own_version()} is tested with Keras "
        f"{', '.join(v + '.x' for v in SUPPORTED_KERAS)}; Keras {version} is "
        "installed. keras_dist replaces Keras's step functions, which change "
        "between Keras releases: install a tested Keras (pip install "
        f"'keras=={SUPPORTED_KERAS[0]}.*') or check results against one "
        "device.",
        stacklevel=3,
    )
    return False


def _own_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("keras-dist")
    except metadata.PackageNotFoundError:  # a source checkout
        return "(source)"
