"""The ``keras-dist`` command: ``keras-dist doctor`` reports what it sees."""

from __future__ import annotations

import argparse
import json
import os
import sys


def doctor(args) -> int:
    """Prints the backend, versions and devices keras_dist would use."""
    if args.cpu_devices:
        os.environ["KERAS_DIST_CPU_DEVICES"] = str(args.cpu_devices)
    import keras

    import keras_dist

    report = {
        "python": sys.version.split()[0],
        "keras": keras.__version__,
        "keras_dist": keras_dist.__version__,
        "backend": keras.backend.backend(),
        "devices": keras_dist.list_devices(),
    }
    try:
        report["mirrored_devices"] = list(keras_dist.MirroredStrategy().devices)
    except keras_dist.KerasDistError as error:
        report["mirrored_devices"] = f"unavailable: {error}"
    print(json.dumps(report, indent=2))
    return 0


def main(argv=None) -> int:
    """Entry point of the ``keras-dist`` console script."""
    parser = argparse.ArgumentParser(prog="keras-dist")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="show backend, versions and devices")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="simulate this many CPU devices first",
    )
    p.set_defaults(func=doctor)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
