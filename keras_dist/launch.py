"""``python -m keras_dist.launch``: the same as ``keras-dist launch``.

Starts ``--nproc-per-node`` workers of this node running a script, with
torchrun-style variables that keras_dist reads on every backend::

    python -m keras_dist.launch --nproc-per-node 2 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import sys

from keras_dist._src.cluster import node_launcher


def main(argv=None) -> int:
    """Parses ``argv`` and runs the workers; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="keras-dist launch",
        description="Start the workers of this node (torchrun-style); "
        "restart them after a failure (--max-restarts) and end a hung job "
        "with every worker's stack (--hang-timeout): see "
        "guides/fault_tolerance.md.",
    )
    node_launcher.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = node_launcher.config_from_args(args)
        return node_launcher.launch(config)
    except ValueError as error:
        parser.error(str(error))
        return 2


if __name__ == "__main__":
    sys.exit(main())
