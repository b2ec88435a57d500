"""Keeps the ``keras-dist`` command quiet at start-up.

Imported first by ``keras_dist/__init__.py``, before Keras imports
TensorFlow. A plain ``import keras_dist`` changes nothing: a library does not
touch its user's environment or warning filters. Only when this process is
the ``keras-dist`` command (``keras-dist doctor`` or ``python -m
keras_dist.cli``) does it default ``TF_CPP_MIN_LOG_LEVEL`` to 1: TensorFlow's
C++ INFO lines (the CPU-feature note printed at import) are hidden, its
warnings and errors still show, since the doctor is there to diagnose.

It also tells the package whether this process needs neither Keras nor a
backend (`needs_no_backend`): the node launcher, and the ``keras-dist``
command for anything but running ``doctor`` (``--help``, ``--version``).
"""

from __future__ import annotations

import os
import sys

CLI_MODULE = "keras_dist.cli"
CLI_NAMES = ("keras-dist", "keras-dist.exe")
LAUNCH_MODULE = "keras_dist.launch"


def _command() -> list[str]:
    """This process's program and its arguments: after ``-m``, the module
    and what follows; else the script's base name and ``sys.argv[1:]``."""
    argv = list(getattr(sys, "orig_argv", None) or ())
    if "-m" in argv:
        return argv[argv.index("-m") + 1 :]
    if not sys.argv:
        return []
    return [os.path.basename(sys.argv[0]), *sys.argv[1:]]


def started_as_cli() -> bool:
    """Whether this process is the ``keras-dist`` command."""
    program = _command()[:1]
    return program == [CLI_MODULE] or (
        bool(program) and program[0] in CLI_NAMES
    )


def started_as_launcher() -> bool:
    """Whether this process is the node launcher: ``python -m
    keras_dist.launch``, ``keras-dist launch`` or ``python -m keras_dist.cli
    launch``."""
    command = _command()
    if command[:1] == [LAUNCH_MODULE]:
        return True
    return started_as_cli() and command[1:2] == ["launch"]


def needs_no_backend() -> bool:
    """Whether this process imports neither Keras nor a backend: the node
    launcher (`started_as_launcher`), or the ``keras-dist`` command for
    anything but running ``doctor`` (``keras-dist --help``, ``--version``,
    ``doctor --help``, a usage error), which then answers in well under a
    second instead of the seconds a backend takes to import."""
    if started_as_launcher():
        return True
    if not started_as_cli():
        return False
    arguments = _command()[1:]
    if arguments[:1] != ["doctor"]:
        return True
    return bool({"-h", "--help"} & set(arguments[1:]))


def quiet_cli_start() -> None:
    """Hides TensorFlow's start-up INFO lines in the ``keras-dist``
    command, unless the user set ``TF_CPP_MIN_LOG_LEVEL``."""
    if started_as_cli() and "tensorflow" not in sys.modules:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


quiet_cli_start()
