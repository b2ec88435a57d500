"""Keeps the ``keras-dist`` command quiet at start-up.

Imported first by ``keras_dist/__init__.py``, before Keras imports
TensorFlow. A plain ``import keras_dist`` changes nothing: a library does not
touch its user's environment or warning filters. Only when this process is
the ``keras-dist`` command (``keras-dist doctor`` or ``python -m
keras_dist.cli``) does it default ``TF_CPP_MIN_LOG_LEVEL`` to 1: TensorFlow's
C++ INFO lines (the CPU-feature note printed at import) are hidden, its
warnings and errors still show, since the doctor is there to diagnose.
"""

from __future__ import annotations

import os
import sys

CLI_MODULE = "keras_dist.cli"
CLI_NAMES = ("keras-dist", "keras-dist.exe")


def started_as_cli() -> bool:
    """Whether this process is the ``keras-dist`` command."""
    argv = list(getattr(sys, "orig_argv", None) or ())
    if "-m" in argv:
        index = argv.index("-m")
        return argv[index + 1 : index + 2] == [CLI_MODULE]
    return bool(sys.argv) and os.path.basename(sys.argv[0]) in CLI_NAMES


def quiet_cli_start() -> None:
    """Hides TensorFlow's start-up INFO lines in the ``keras-dist``
    command, unless the user set ``TF_CPP_MIN_LOG_LEVEL``."""
    if started_as_cli() and "tensorflow" not in sys.modules:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


quiet_cli_start()
