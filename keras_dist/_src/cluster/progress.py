"""Training progress that workers report to ``keras-dist launch``.

Backend-free (the launcher imports neither Keras nor a backend). Under
``keras-dist launch --max-restarts N`` or with a hang timeout, the launcher
makes a directory and names it in ``KERAS_DIST_PROGRESS_DIR``; each worker's
`fit` then writes one small file there, ``rank-<R>``, at every train batch
end (and a heartbeat at each test/predict batch and epoch edge): its state
(``start``: in `fit` before its first step, ``train``, ``done``: `fit`
returned), the epoch, the batch in the epoch and the global step. The write
is one ``pwrite`` of 80 bytes to a file kept open (about a microsecond).
The launcher reads the files (`ProgressBoard`) to tell where a failed worker
was (a failure repeated at the same step is a bug, not a fault) and which
worker stopped making progress (a hang).

A worker started with a progress directory also dumps every thread's
Python stack to stderr on `STACK_SIGNAL` (`register_stack_dump`), which the
launcher sends to every worker when one hangs.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import threading
import time

ENV_PROGRESS_DIR = "KERAS_DIST_PROGRESS_DIR"
ENV_HANG_TIMEOUT = "KERAS_DIST_HANG_TIMEOUT"
ENV_STARTUP_TIMEOUT = "KERAS_DIST_STARTUP_TIMEOUT"
ENV_RESTART_COUNT = "KERAS_DIST_RESTART_COUNT"
#: The signal on which a launched worker dumps its threads' stacks. Not
#: SIGUSR1: the launcher forwards that one (SLURM's ``--signal``) and
#: `BackupAndRestore` may save for preemption on it.
STACK_SIGNAL = signal.SIGUSR2
_WIDTH = 80


def positive_seconds(name: str, value) -> float | None:
    """`value` (a string or number, from an option or a variable) as a
    positive number of seconds; None for an empty or missing value.

    Raises:
        ValueError: naming `name`, for anything else.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(
            f"{name}={value!r} is not a positive number of seconds."
        )
    return seconds


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a worker's `fit` stood at its last report."""

    state: str  # "start" (no step ran yet), "train" or "done"
    epoch: int
    batch: int  # the batch in the epoch, -1 before the first
    step: int  # the global step, -1 when unknown (no steps per epoch)

    def where(self) -> tuple:
        """What two failures compare: the epoch and batch of the last
        step, ``(-1, -1)`` before the first."""
        return (-1, -1) if self.batch < 0 else (self.epoch, self.batch)

    def describe(self) -> str:
        """``"step 12"``, ``"epoch 2, batch 3"`` or ``"before its first
        step"``."""
        if self.batch < 0:
            return "before its first step"
        if self.step >= 0:
            return f"step {self.step}"
        return f"epoch {self.epoch}, batch {self.batch}"

    @staticmethod
    def parse(text: str) -> Position | None:
        """A position from a progress file's text; None if unreadable."""
        fields = text.split()
        if len(fields) < 5 or fields[0] not in ("start", "train", "done"):
            return None
        try:
            epoch, batch, step = (int(f) for f in fields[1:4])
        except ValueError:
            return None
        return Position(fields[0], epoch, batch, step)


class ProgressWriter:
    """A worker's progress file (see the module docstring).

    Args:
        directory: the launcher's ``KERAS_DIST_PROGRESS_DIR``.
        rank: this worker's rank.
    """

    def __init__(self, directory: str, rank: int):
        self.directory = directory
        self.path = os.path.join(directory, f"rank-{rank}")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._beats = 0
        self._fields = ("start", 0, -1, -1)
        # Keras may run batch ends on a thread of its own (async dispatch).
        self._lock = threading.Lock()

    def report(self, state=None, epoch=None, batch=None, step=None) -> None:
        """Writes the position, with the given fields changed; every
        call changes the file (a heartbeat counter)."""
        with self._lock:
            self._report(state, epoch, batch, step)

    def _report(self, state, epoch, batch, step) -> None:
        if self._fd is None:
            return
        old = self._fields
        self._fields = (
            old[0] if state is None else state,
            old[1] if epoch is None else epoch,
            old[2] if batch is None else batch,
            old[3] if step is None else step,
        )
        self._beats += 1
        line = " ".join(str(f) for f in (*self._fields, self._beats))
        try:
            os.pwrite(self._fd, line.ljust(_WIDTH - 1).encode() + b"\n", 0)
        except OSError:
            pass  # the launcher's directory is gone: it is ending the job

    def close(self) -> None:
        """Closes the file (it stays for the launcher to read)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


_stack_dump_registered = False


def register_stack_dump() -> bool:
    """In a worker of ``keras-dist launch`` that reports progress: dumps
    every thread's Python stack to stderr on `STACK_SIGNAL` (the process
    goes on). A C-level handler (`faulthandler`), so a thread stuck in a
    collective or holding the GIL does not stop the dump. Idempotent.

    Returns:
        Whether the dump is registered.
    """
    global _stack_dump_registered
    if _stack_dump_registered:
        return True
    if not os.environ.get(ENV_PROGRESS_DIR) or not hasattr(
        faulthandler, "register"
    ):
        return False
    try:
        faulthandler.register(STACK_SIGNAL, all_threads=True, chain=False)
    except (RuntimeError, ValueError, OSError):
        return False
    _stack_dump_registered = True
    return True


@dataclasses.dataclass
class _Seen:
    text: str
    changed_at: float


class ProgressBoard:
    """The launcher's view of its workers' progress files.

    Args:
        directory: the progress directory.
        ranks: the ranks of this node's workers.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, directory: str, ranks, clock=time.monotonic):
        self.directory = directory
        self.ranks = list(ranks)
        self.clock = clock
        self.started = clock()
        self._seen: dict[int, _Seen] = {}

    def poll(self) -> None:
        """Reads every file; notes when each one last changed."""
        now = self.clock()
        for rank in self.ranks:
            path = os.path.join(self.directory, f"rank-{rank}")
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:
                continue
            seen = self._seen.get(rank)
            if seen is None or seen.text != text:
                self._seen[rank] = _Seen(text, now)

    def position(self, rank: int) -> Position | None:
        """The last position `rank` reported (None: none yet)."""
        seen = self._seen.get(rank)
        return None if seen is None else Position.parse(seen.text)

    def idle(self, rank: int) -> float:
        """Seconds since `rank` last reported (since the start if never)."""
        seen = self._seen.get(rank)
        since = self.started if seen is None else seen.changed_at
        return self.clock() - since

    def stalled(self, hang_timeout, startup_timeout) -> list[int]:
        """The ranks that made no progress within their timeout: the hang
        timeout once they finished a step in this `fit`, the start-up
        timeout before (compiling the first step may take long). A worker
        out of `fit` is not watched.

        Args:
            hang_timeout: seconds, or None (off).
            startup_timeout: seconds, or None (off).
        """
        stalled = []
        for rank in self.ranks:
            position = self.position(rank)
            if position is not None and position.state == "done":
                continue
            started = position is not None and position.state == "train"
            limit = hang_timeout if started else startup_timeout
            if limit is not None and self.idle(rank) > limit:
                stalled.append(rank)
        return stalled
