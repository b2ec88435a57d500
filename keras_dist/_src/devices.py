"""Device names (Keras style, ``"gpu:0"``) and simulated CPU devices."""

from __future__ import annotations

import os
import re

_DEVICE_RE = re.compile(
    r"^(?:/?(?:job:\w+/)?(?:replica:\d+/)?(?:task:\d+/)?"
    r"(?:device:)?)?(cpu|gpu|tpu):(\d+)$",
    re.IGNORECASE,
)

ENV_CPU_DEVICES = "KERAS_DIST_CPU_DEVICES"


def too_late_to_simulate(backend: str, count: int) -> str:
    """What to do when `count` simulated CPU devices come after `backend`
    started its devices (the end of a `DevicesAlreadyInitializedError`)."""
    value = os.environ.get(ENV_CPU_DEVICES)
    if value:
        return (
            f"{ENV_CPU_DEVICES}={value} is set, but it is applied when "
            f"keras_dist is imported, and {backend} had started before: "
            f"import keras_dist before anything uses {backend} (an array, "
            "a device list, a Keras model)."
        )
    return (
        f"Call keras_dist.simulate_cpu_devices({count}) (or set "
        f"{ENV_CPU_DEVICES}) before any {backend} operation, e.g. right "
        "after `import keras_dist`."
    )


def normalize_device(name: str) -> str:
    """Returns ``"type:index"`` for a device name such as ``"GPU:1"``.

    Accepts Keras names (``"gpu:0"``) and TensorFlow names
    (``"/device:GPU:0"``).

    Raises:
        ValueError: if `name` is not a device name.
    """
    if not isinstance(name, str):
        raise ValueError(
            f"Device names are strings like 'gpu:0' or 'cpu:1'; got {name!r}."
        )
    match = _DEVICE_RE.match(name.strip())
    if not match:
        raise ValueError(
            f"Cannot parse device name {name!r}. Use 'TYPE:INDEX' with TYPE "
            "one of cpu, gpu, tpu, e.g. 'gpu:0' or 'cpu:1'."
        )
    return f"{match.group(1).lower()}:{int(match.group(2))}"


def check_devices_exist(requested, available) -> list[str]:
    """Normalizes `requested` and checks each is in `available`.

    Raises:
        ValueError: naming the missing devices and listing those that exist.
    """
    requested = [normalize_device(d) for d in requested]
    if not requested:
        raise ValueError("`devices` is empty: pass at least one device name.")
    if len(set(requested)) != len(requested):
        raise ValueError(f"`devices` lists a device twice: {requested}.")
    missing = [d for d in requested if d not in available]
    if missing:
        kinds = {d.split(":")[0] for d in missing}
        seen = {a.split(":")[0] for a in available}
        unseen = sorted(k for k in kinds if k not in seen and k != "cpu")
        hint = (
            f" This process sees no {' or '.join(k.upper() for k in unseen)}"
            ": check that the backend's build for it is installed (jax[cuda12]"
            " or jax[tpu], a CUDA build of torch, tensorflow[and-cuda]) and "
            "that the device is visible here (`nvidia-smi`, "
            "CUDA_VISIBLE_DEVICES), or run `keras-dist doctor`."
            if unseen
            else ""
        )
        raise ValueError(
            f"Device(s) {missing} do not exist. Available devices: "
            f"{list(available)}.{hint} To simulate N CPU devices for "
            f"development, call keras_dist.simulate_cpu_devices(N) (or set "
            f"{ENV_CPU_DEVICES}=N) before the backend starts."
        )
    return requested


def requested_cpu_devices_from_env() -> int | None:
    """Returns the simulated device count asked for in the environment."""
    value = os.environ.get(ENV_CPU_DEVICES)
    if not value:
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(
            f"{ENV_CPU_DEVICES}={value!r} is not a positive integer; set it "
            "to the number of CPU devices to simulate, e.g. 4."
        )
    return count


def sum_over(devices) -> tuple[float, str]:
    """What an all-reduce sum of 1, 2, ..., N over N `devices` gives, and
    how to say what it reduced over (`keras-dist doctor`)."""
    n = len(devices)
    return float(n * (n + 1) // 2), f"{n} device{'s' if n != 1 else ''}"
