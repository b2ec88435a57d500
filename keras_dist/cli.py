"""The ``keras-dist`` command: ``keras-dist doctor`` checks this machine.

``keras-dist doctor`` reports the Keras backend, the versions that matter,
the devices, the cluster environment the launcher variables describe, what
``keras_dist.MirroredStrategy()`` would use, what the job would listen on
(and on which interface), and whether a small all-reduce
over those devices works (and how long it took). It exits with status 1 and
says why when something is wrong. It never starts training processes: on
torch, where ``MirroredStrategy()`` starts one process per device, it only
says what the strategy would start.

    keras-dist doctor [--cpu-devices N] [--json]
    python -m keras_dist.cli doctor [--cpu-devices N] [--json]
    keras-dist --version

Only ``doctor`` imports Keras and the backend: ``--help``, ``--version``
and ``launch`` answer without them (see ``keras_dist/_src/quiet.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time

# Variables a launcher sets to place this process in a job. Reported as they
# are, beside what keras_dist makes of them.
_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TF_CONFIG",
)
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_COMM_WORLD_")
# Settings that change what keras_dist sees.
_SETTINGS = (
    "KERAS_BACKEND",
    "KERAS_DIST_CPU_DEVICES",
    "XLA_FLAGS",
    "CUDA_VISIBLE_DEVICES",
    "JAX_PLATFORMS",
    "KERAS_DIST_BIND_ALL",
    "KERAS_DIST_CPU_BINDING",
    "KERAS_DIST_CPU_ALLOCATOR",
)


def _version(module_name: str) -> str | None:
    try:
        module = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - not installed or broken: say so.
        return None
    return getattr(module, "__version__", "unknown")


def _backend_module():
    """The keras_dist module that drives the active backend."""
    errors = []
    for name in ("keras_dist._src.backends", "keras_dist._src.backend"):
        try:
            package = importlib.import_module(name)
        except ModuleNotFoundError as error:
            errors.append(str(error))
            continue
        return package.get()
    raise ImportError("; ".join(errors))


def _launcher_variables() -> dict:
    found = {}
    for name in sorted(os.environ):
        if name in _LAUNCHER_VARIABLES or name.startswith(_LAUNCHER_PREFIXES):
            found[name] = os.environ[name]
    return found


def _cluster() -> dict:
    """What the launcher variables say about this process's place."""
    report = {"variables": _launcher_variables()}
    try:
        from keras_dist._src.cluster import detect_environment
    except ImportError:
        report["environment"] = None
        return report
    environment = detect_environment()  # errors are reported by the caller
    if hasattr(environment, "__dataclass_fields__"):
        import dataclasses

        environment = dataclasses.asdict(environment)
        environment["worker_addresses"] = list(
            environment.get("worker_addresses") or []
        )
    else:
        environment = repr(environment)
    report["environment"] = environment
    return report


def _listens(backend: str, processes: int, problems: list) -> list | None:
    """What a job started here would listen on, and where (None when the
    cluster environment cannot be read: the cluster row says why)."""
    from keras_dist._src.cluster import binding, detect_environment

    try:
        environment = detect_environment()
    except Exception:  # noqa: BLE001 - reported with the cluster
        return None
    try:
        return binding.endpoints(backend, environment, processes)
    except ValueError as error:  # a bad KERAS_DIST_BIND_ALL
        problems.append(str(error))
        return None


def _cpu_ranks(problems: list) -> dict:
    """What torch's CPU ranks do with their cores and their malloc
    (`KERAS_DIST_CPU_BINDING`, `KERAS_DIST_CPU_ALLOCATOR`); a bad setting,
    which would stop the job at its start, is a problem."""
    from keras_dist._src.cluster import allocator, launcher

    ranks = {}
    for key, read in (
        ("binding", launcher.cpu_binding),
        ("allocator", allocator.allocator_setting),
    ):
        try:
            ranks[key] = read()
        except ValueError as error:
            problems.append(str(error))
    if ranks.get("allocator") == "auto":
        own = [n for n in allocator.USER_VARIABLES if n in os.environ]
        if own:
            ranks["allocator"] = f"yours ({own[0]} is set)"
        elif allocator.glibc() is None:
            ranks["allocator"] = "as it is (the C library is not glibc)"
        else:
            ranks["allocator"] = "glibc's malloc keeps freed memory"
    return ranks


def collect(cpu_devices: int = 0) -> dict:
    """Builds the doctor's report; ``report["problems"]`` lists what is
    wrong (empty when all is well)."""
    problems = []
    report = {
        "backend": None,
        "backend_from": (
            "KERAS_BACKEND"
            if os.environ.get("KERAS_BACKEND")
            else "Keras config file or default"
        ),
        "versions": {
            "python": platform.python_version(),
            "numpy": _version("numpy"),
            "keras": _version("keras"),
            "keras_dist": _version("keras_dist"),
        },
        "settings": {k: os.environ[k] for k in _SETTINGS if k in os.environ},
        "devices": None,
        "mirrored_strategy": None,
        "cluster": None,
        "listens": None,
        "all_reduce": None,
        "problems": problems,
    }
    try:
        import keras_dist
    except Exception as error:  # noqa: BLE001
        problems.append(f"cannot import keras_dist: {error}")
        return report
    from keras_dist._src import backends as backend_lib

    backend = backend_lib.name()  # reported, never compared
    report["backend"] = backend
    try:
        module = _backend_module()
    except Exception as error:  # noqa: BLE001
        problems.append(f"backend {backend!r}: {error}")
        return report
    report["versions"].update(module.framework_versions())
    per_device = module.CAPABILITIES.process_per_device

    # Before anything asks the backend for its devices: `import keras_dist`
    # ran before this function, so the environment variable alone is late.
    if cpu_devices:
        try:
            keras_dist.simulate_cpu_devices(int(cpu_devices))
        except Exception as error:  # noqa: BLE001
            problems.append(f"--cpu-devices {cpu_devices}: {error}")

    try:
        report["devices"] = keras_dist.list_devices()
    except Exception as error:  # noqa: BLE001
        problems.append(f"cannot list devices: {error}")
        return report

    try:
        devices = list(module.default_devices())
    except Exception as error:  # noqa: BLE001
        problems.append(f"MirroredStrategy() has no devices: {error}")
        devices = []
    mirrored = {"devices": devices, "replicas": len(devices)}
    if per_device:
        mirrored["processes"] = len(devices)
        mirrored["note"] = (
            f"starts {len(devices)} processes (one per device) unless a "
            "launcher already started them"
            if len(devices) > 1
            else "runs in this process"
        )
    else:
        mirrored["processes"] = 1
    report["mirrored_strategy"] = mirrored
    if per_device and devices and devices[0].startswith("cpu"):
        report["cpu_ranks"] = _cpu_ranks(problems)
    report["mesh"] = _mesh_report(module, backend, devices)
    if cpu_devices and devices and devices[0].startswith("cpu"):
        if len(devices) != cpu_devices:
            problems.append(
                f"asked for {cpu_devices} simulated CPU devices, but "
                f"MirroredStrategy() would use {len(devices)}: {devices}"
            )

    try:
        report["cluster"] = _cluster()
    except Exception as error:  # noqa: BLE001
        report["cluster"] = {
            "variables": _launcher_variables(),
            "environment": {"error": str(error)},
        }
        problems.append(f"cluster environment: {error}")
    environment = report["cluster"].get("environment") or {}
    report["listens"] = _listens(backend, len(devices), problems)
    if per_device and environment.get("world_size", 1) > 1:
        mirrored["note"] = (
            f"joins the {environment['source']} job as rank "
            f"{environment['rank']} of {environment['world_size']}"
        )

    if devices:
        total = expected = over = None
        start = time.perf_counter()
        try:
            total, expected, over = module.all_reduce_check(devices)
        except Exception as error:  # noqa: BLE001
            problems.append(
                f"all-reduce over {devices} failed: "
                f"{type(error).__name__}: {error}"
            )
        seconds = time.perf_counter() - start
        report["all_reduce"] = {
            "over": over,
            "result": total,
            "expected": expected,
            "ok": total is not None and total == expected,
            "seconds": round(seconds, 3),
        }
        if total is not None and total != expected:
            problems.append(
                f"all-reduce over {over} gave {total}, not {expected}"
            )
    return report


def _format(report: dict) -> str:
    lines = []

    def row(name, value):
        lines.append(f"{name:<20} {value}")

    settings = dict(report["settings"])
    chosen = settings.pop("KERAS_BACKEND", None)
    source = (
        f"KERAS_BACKEND={chosen}"
        if chosen
        else "KERAS_BACKEND unset: Keras's config file or default"
    )
    row("backend", f"{report['backend']} ({source})")
    row(
        "versions",
        ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v),
    )
    if settings:
        row("settings", " ".join(f"{k}={v}" for k, v in settings.items()))
    if report["devices"] is not None:
        row("devices", " ".join(report["devices"]) or "none")
    mirrored = report["mirrored_strategy"]
    if mirrored is not None:
        count = mirrored["replicas"]
        text = (
            f"{count} replica{'s' if count != 1 else ''} on "
            f"{' '.join(mirrored['devices'])}"
        )
        if "note" in mirrored:
            text += f"; {mirrored['note']}"
        row("MirroredStrategy()", text)
    cpu_ranks = report.get("cpu_ranks")
    if cpu_ranks:
        row(
            "CPU ranks",
            ", ".join(f"{key}: {value}" for key, value in cpu_ranks.items()),
        )
    mesh = report.get("mesh")
    if mesh:
        row("mesh", mesh["text"])
    cluster = report["cluster"]
    if cluster is not None:
        environment = cluster.get("environment")
        if isinstance(environment, dict) and "error" in environment:
            text = f"ERROR: {environment['error']}"
        elif isinstance(environment, dict):
            text = (
                f"{environment['source']}: rank {environment['rank']} of "
                f"{environment['world_size']}"
            )
            if environment.get("coordinator_host"):
                text += (
                    f", coordinator {environment['coordinator_host']}:"
                    f"{environment['coordinator_port']}"
                )
        elif environment is None:
            text = "not detected by this keras_dist version"
        else:
            text = str(environment)
        row("cluster", text)
        variables = cluster["variables"]
        row(
            "launcher variables",
            " ".join(f"{k}={v}" for k, v in variables.items()) or "none set",
        )
    listens = report.get("listens")
    if listens is not None:
        for i, line in enumerate(listens or ["nothing (one process)"]):
            row("listens" if i == 0 else "", line)
        if any("0.0.0.0" in line for line in listens):
            row("", "keep the job on a private network or behind a firewall")
    result = report["all_reduce"]
    if result is not None:
        if result["ok"]:
            text = (
                f"ok: sum over {result['over']} = {result['result']} "
                f"(expected {result['expected']}) in {result['seconds']:.3f} s"
            )
        else:
            text = f"FAILED after {result['seconds']:.3f} s (see below)"
        row("all-reduce", text)
    if report["problems"]:
        lines.append("")
        for problem in report["problems"]:
            lines.append(f"PROBLEM: {problem}")
    else:
        lines.append("")
        lines.append("OK: nothing wrong found.")
    return "\n".join(lines)


def _mesh_report(module, backend, devices) -> dict:
    """What a mesh strategy would use here: the default 1-D mesh of
    ShardedDataParallel() and how a ModelParallel mesh of these devices
    could be shaped (where the backend runs layouts)."""
    from keras_dist._src.plan import LayoutPlan

    if LayoutPlan in module.CAPABILITIES.refused_plans:
        return {
            "text": "ModelParallel / ShardedDataParallel: not available on "
            f"{backend} (use jax or torch)"
        }
    n = len(devices)
    shapes = [(n // m, m) for m in range(1, n + 1) if n % m == 0]
    return {
        "devices": list(devices),
        "default": [n],
        "model_parallel_shapes": shapes,
        "text": (
            f"ShardedDataParallel() -> DeviceMesh(({n},), ('batch',)); "
            "ModelParallel meshes (batch, model) of these devices: "
            + ", ".join(f"{a}x{b}" for a, b in shapes)
            + " (across workers: every device of every worker)"
        ),
    }


def doctor(args) -> int:
    """Prints what keras_dist sees here; returns 1 when something is
    wrong, else 0."""
    report = collect(args.cpu_devices)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_format(report))
    return 1 if report["problems"] else 0


def main(argv=None) -> int:
    """Entry point of the ``keras-dist`` console script."""
    from keras_dist import __version__

    parser = argparse.ArgumentParser(prog="keras-dist")
    parser.add_argument(
        "--version",
        action="version",
        version=f"keras_dist {__version__}",
        help="print keras_dist's version and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "doctor",
        help="check the backend, versions, devices, cluster and all-reduce",
        description=(
            "Reports the Keras backend, versions, devices, the cluster "
            "environment, what MirroredStrategy() would use and whether an "
            "all-reduce over those devices works. Exits 1 when something "
            "is wrong. Starts no training process."
        ),
    )
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        metavar="N",
        help="simulate N CPU devices first (as KERAS_DIST_CPU_DEVICES=N)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the report as JSON"
    )
    p.set_defaults(func=doctor)
    from keras_dist._src.cluster import node_launcher

    launch = sub.add_parser(
        "launch",
        help="start the workers of this node (torchrun-style)",
        description=(
            "Starts --nproc-per-node workers of this node running a script, "
            "with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT "
            "set (and TF_CONFIG on TensorFlow). Prefixes output lines with "
            "the rank, forwards SIGINT/SIGTERM/SIGUSR1, and exits non-zero "
            "(the failed worker's code) when any worker fails, stopping the "
            "rest. --max-restarts N starts the node's workers again after "
            "a failure, kill, hang or preemption (BackupAndRestore resumes "
            "at the saved step); --hang-timeout ends a job that stops "
            "making progress, with every worker's stack "
            "(guides/fault_tolerance.md). With --ps N --workers M: a whole "
            "ParameterServerStrategy job on this host (TensorFlow; "
            "guides/parameter_server.md)."
        ),
    )
    node_launcher.add_arguments(launch)

    def run_launch(arguments):
        try:
            config = node_launcher.config_from_args(arguments)
            config.check()
        except ValueError as error:  # options that do not go together
            launch.error(str(error))  # usage and the reason; exit code 2
        return node_launcher.launch(config)

    launch.set_defaults(func=run_launch)
    args = parser.parse_args(argv)
    if getattr(args, "cpu_devices", 0) and args.cpu_devices < 1:
        parser.error("--cpu-devices needs a positive integer")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
