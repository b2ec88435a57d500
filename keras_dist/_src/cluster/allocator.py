"""Keeping freed memory in a CPU rank: glibc's malloc tuned for steps.

A training step on a CPU allocates and frees the same few large tensors
(activations, gradients, DDP's buckets) every step. glibc's malloc, as it
comes, gives memory back to the kernel whenever more than about twice the
largest recent block lies free at the top of its heap, and serves blocks
above a threshold with a fresh ``mmap``; the next step then touches new
pages, one minor fault (a zeroed 4 KiB page) each. Measured on the 2-core
machine of `guides/performance.md` (`bench_torch.py`'s dense model): 6,800
faults a step in one-process Keras, 500 to 16,000 on a keras_dist rank,
often far apart on the two ranks of one job, so that one rank is slower
and the other waits for it at every collective. With the thresholds
below: 10 to 150 on every rank.

`tune_allocator` sets them with ``mallopt`` (what ``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_`` set at a process's start, and in the spirit
of torch's CPU launcher, which preloads jemalloc or tcmalloc): blocks up to
32 MiB come from the heap, and up to 256 MiB of free memory stays mapped
for the next step. The price is memory: the process keeps what it frees
(up to 256 MiB free at the top of its heap) mapped instead of returning
it, so its resident size stays near its peak (on the dense model, 4 to
70 MiB above an untuned process's after `fit`).

``KERAS_DIST_CPU_ALLOCATOR``: ``auto`` (default: tune the CPU ranks of a
torch job) or ``none`` (leave malloc as it is). A process started with any
``MALLOC_*`` variable of its own, or whose C library is not glibc (macOS,
musl; or jemalloc/tcmalloc preloaded, where glibc's settings do nothing)
is left as it is.
"""

from __future__ import annotations

import ctypes
import os

ENV_CPU_ALLOCATOR = "KERAS_DIST_CPU_ALLOCATOR"
_SETTINGS = ("auto", "none")
#: glibc's ``mallopt`` parameters (``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap (glibc's largest on 64 bits).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap kept mapped.
TRIM_THRESHOLD = 256 << 20
#: Variables with which a user tunes glibc's malloc themselves.
USER_VARIABLES = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


def allocator_setting() -> str:
    """This process's ``KERAS_DIST_CPU_ALLOCATOR`` (default ``auto``).

    Raises:
        ValueError: for a value that is not ``auto`` or ``none``.
    """
    value = os.environ.get(ENV_CPU_ALLOCATOR, "auto").strip().lower()
    value = value or "auto"
    if value not in _SETTINGS:
        raise ValueError(
            f"{ENV_CPU_ALLOCATOR}={value!r} is not one of "
            f"{', '.join(_SETTINGS)}: `auto` keeps the memory a CPU rank "
            "frees mapped for its next step (fewer page faults), `none` "
            "leaves malloc as it is."
        )
    return value


def glibc():
    """The process's C library if it is glibc, else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        return libc
    except (OSError, AttributeError):
        return None


def tune_allocator() -> bool:
    """Keeps freed memory mapped in this process (see the module's text).

    Returns:
        Whether glibc's malloc was tuned: False with
        ``KERAS_DIST_CPU_ALLOCATOR=none``, with a ``MALLOC_*`` variable of
        the user's, or without glibc.

    Raises:
        ValueError: for an unknown ``KERAS_DIST_CPU_ALLOCATOR``.
    """
    if allocator_setting() == "none":
        return False
    if any(name in os.environ for name in USER_VARIABLES):
        return False
    libc = glibc()
    if libc is None:
        return False
    # The mmap threshold first: setting either turns off glibc's own
    # moving thresholds, and a trim threshold alone would leave every
    # block above 128 KiB to mmap (worse than glibc's default).
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
