"""Supervision of a job's processes: failures stop every rank, never a hang.

Failures travel through a key/value store (for torch, a ``TCPStore`` client
to the rendezvous store): the first rank that fails writes
``"rank R: Type: message"`` under `ERROR_KEY`; every rank's `Watchdog` polls
that key and stops its process with a message naming the failing rank. The
process that started the others (rank 0 of a relaunched job, or
``keras-dist launch``) runs a `Supervisor` over its children.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import subprocess
import sys
import threading
import time

ERROR_KEY = "keras_dist/error"


# How often watch threads poll; tests set it low to widen exit-time races.
POLL_SECONDS = float(os.environ.get("KERAS_DIST_POLL_SECONDS", "0.5"))
# Seconds a rank stopped by another rank's reported failure waits before it
# exits, so that the failed rank exits first and the launcher names it.
PEER_FAILURE_GRACE = 3.0


EXIT_CODE = 1
# A rank that stopped for preemption after the job saved its checkpoint
# (`keras_dist.callbacks.BackupAndRestore`) exits with EX_TEMPFAIL: not a
# failure; the job as a whole exits with it too, so that it is requeued.
PREEMPTION_EXIT_CODE = 75
"""Exit status of a process that stopped for preemption after saving (75,
``EX_TEMPFAIL``): not a failure; requeue the job and it resumes."""
#: Seconds the rendezvous store may be unreachable before a rank concludes
#: that rank 0 died.
STORE_LOSS_SECONDS = 10.0
ENV_TIMEOUT = "KERAS_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 120


def liveness_timeout() -> int:
    """Seconds a worker waits for the others before the job is stopped.

    ``KERAS_DIST_TIMEOUT`` (default 120): the torch process group's
    timeout, TensorFlow's collective timeout and `jax.distributed`'s
    heartbeat timeout, so that a dead or hung worker stops every other
    worker instead of hanging the job.

    Raises:
        ValueError: when ``KERAS_DIST_TIMEOUT`` is not a positive integer.
    """
    value = os.environ.get(ENV_TIMEOUT, "")
    if not value:
        return DEFAULT_TIMEOUT_S
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(
            f"{ENV_TIMEOUT}={value!r} is not a positive whole number of "
            "seconds; set it to e.g. 120."
        )
    return int(value.strip())


#: Names the pipe a worker started by keras_dist watches where Linux's
#: parent-death signal is not available (`launcher.spawn`).
ENV_PARENT_PIPE = "KERAS_DIST_PARENT_PIPE"
_launcher_watch: threading.Thread | None = None


def watch_launcher() -> None:
    """Ends this process when the launcher that started it dies.

    Only for workers started where Linux's parent-death signal is missing:
    `launcher.spawn` then passes the read end of a pipe whose write end
    only the launcher holds (``KERAS_DIST_PARENT_PIPE``); the pipe's end of
    file means the launcher is gone, however it died. A no-op elsewhere
    and when called again.
    """
    global _launcher_watch
    value = os.environ.get(ENV_PARENT_PIPE, "")
    if _launcher_watch is not None or not value.isdigit():
        return
    fd = int(value)

    def watch():
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        log("the launcher that started this worker died; stopping.")
        os._exit(EXIT_CODE)

    _launcher_watch = threading.Thread(
        target=watch, name="keras_dist-launcher-watch", daemon=True
    )
    _launcher_watch.start()


def keep_sigterm_fatal() -> None:
    """After a backend's distributed start-up: SIGTERM stops the worker
    again.

    JAX's preemption service (`jax.distributed.initialize`) and
    TensorFlow's coordination service install a C handler for SIGTERM that
    only records it for their own preemption sync points, so a worker
    ignored `kill`, `timeout`, `scancel` and a pod's deletion (and the
    launcher's forwarded SIGTERM) until SIGKILL. keras_dist watches SIGTERM
    itself where it saves for preemption (BackupAndRestore, during `fit`);
    everywhere else SIGTERM has its default action again, as in a torch
    job. A Python handler the program set before is put back in place.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    signal.signal(
        signal.SIGTERM, signal.SIG_DFL if handler is None else handler
    )


_exit_requests: list = []


def track_exit_requests() -> None:
    """Records the status of every ``sys.exit`` of the main thread, so
    that exit handlers can tell a failing exit (`failing_exit_code`).
    Idempotent. ``raise SystemExit(n)`` and the ``exit()`` builtin are not
    seen (Python gives exit handlers no exit status)."""
    original = sys.exit
    if getattr(original, "_keras_dist_tracked", False):
        return

    def exit(status=None):
        # In another thread sys.exit ends only that thread.
        if threading.current_thread() is threading.main_thread():
            _exit_requests.append(status)
        original(status)

    exit.__doc__ = original.__doc__
    exit._keras_dist_tracked = True
    sys.exit = exit


def failing_exit_code() -> int | None:
    """The failing code this process is exiting with, as far as it is
    seen from an exit handler: 1 after an uncaught exception in the main
    thread, n after a main-thread ``sys.exit(n)`` with a failing status
    (once `track_exit_requests` ran); None for a clean exit."""
    if getattr(sys, "last_value", None) is not None:
        return 1  # set by Python before it prints an uncaught exception
    if not _exit_requests:
        return None
    status = _exit_requests[-1]
    code = status if isinstance(status, int) else int(status is not None)
    return code or None


#: Key every rank sets in the job's store when its process exits.
EXITED_KEY = "keras_dist/exited/{rank}"


def leave_job(rank: int, world_size: int, set_key, wait_key=None) -> None:
    """This process's last word to the job, from its exit handler.

    Every rank sets `EXITED_KEY` as it exits (`agree_on_call` reads it: a
    call that waits for a rank that has left fails at once). Rank 0's
    process hosts the job's store (torch's rendezvous store, TensorFlow's
    coordination service): when it exits, the others lose it, and one
    still reading a value from it (the chief's outcome of a
    `save_weights`, a last collective) fails although the job succeeded.
    So rank 0, at a clean exit, also waits until every other rank has set
    its key (at most the liveness timeout) before its process and the
    store go. A failing rank 0 exits at once (the others then stop, as
    before).

    Args:
        rank, world_size: this process's place in the job.
        set_key: ``set_key(key, text)`` sets a key in the job's store.
        wait_key: ``wait_key(key, seconds)`` returns whether `key` was set
            within `seconds`; None: rank 0 does not wait (JAX's shutdown
            barrier waits instead).
    """
    if world_size <= 1:
        return
    try:
        set_key(EXITED_KEY.format(rank=rank), "1")
    except Exception:  # noqa: BLE001 - rank 0 (the store) is gone.
        pass
    if rank != 0 or wait_key is None:
        return
    if failing_exit_code() is not None:
        return
    deadline = time.monotonic() + liveness_timeout()
    for other in range(1, world_size):
        left = deadline - time.monotonic()
        try:
            done = left > 0 and wait_key(EXITED_KEY.format(rank=other), left)
        except Exception:  # noqa: BLE001 - the store's own error types
            done = False
        if not done:
            log(
                f"rank 0 waited {liveness_timeout()} s at its exit for rank "
                f"{other} to finish, and it did not; rank 0 exits now, and "
                "the job's store with it."
            )
            return


def rejoin_error(library: str):
    """The error for a strategy created after this process left its job
    (an earlier strategy failed to start): `library` cannot join a job
    twice in one process."""
    from keras_dist._src.errors import KerasDistError

    return KerasDistError(
        "This process left its job when a strategy failed to start earlier "
        f"in this program (the error raised then), and {library} cannot "
        "join a job twice in one process. Fix what that error named and "
        "create the strategy once, at the top of the program."
    )


_CALLS = itertools.count(1)


def agree_on_call(runtime, name: str, hint: str | None = None) -> None:
    """Makes sure every process makes this `fit`/`evaluate`/`predict` call.

    They are collective: a call made on some processes only (``if
    strategy.is_chief: model.evaluate(...)``) waited in its first
    collective for processes that never came, until a timeout, and on
    JAX for ever (a peer waiting in JAX's shutdown barrier is alive).
    Every process now publishes the name of its n-th call in the job's
    store and reads the others': a rank that has left the program
    (`EXITED_KEY`), a rank that makes another call, or none within the
    liveness timeout, fails the call at once with what to do.

    Args:
        runtime: the job's Runtime (`publish`, `wait_for`, rank and
            world size; a store of key-values).
        name: the call (``"fit"``, ``"evaluate"``, ``"predict"``, or a
            save that reads variables collectively).
        hint: what to do, in the errors (default: fit, evaluate and
            predict are collective).

    Raises:
        KerasDistError: naming the rank and what it did instead.
    """
    from keras_dist._src.errors import KerasDistError

    number = next(_CALLS)
    me = runtime.rank
    runtime.publish(f"keras_dist/call/{number}/{me}", name)
    timeout = liveness_timeout()
    deadline = time.monotonic() + timeout
    collective = hint or (
        f"`{name}` is collective: call fit, evaluate and predict on every "
        "process, with the same arguments (not under `if "
        "strategy.is_chief:`)."
    )
    for other in range(runtime.world_size):
        if other == me:
            continue
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KerasDistError(
                    f"Rank {me} called `{name}` (its call {number}), and rank "
                    f"{other} did not make a call {number} within {timeout} "
                    f"s (KERAS_DIST_TIMEOUT). " + collective
                )
            start = time.monotonic()
            slice_ = min(1.0, left)
            key = f"keras_dist/call/{number}/{other}"
            called = runtime.wait_for(key, slice_)
            if called is not None:
                break
            if runtime.wait_for(EXITED_KEY.format(rank=other), 0.001):
                raise KerasDistError(
                    f"Rank {me} called `{name}` after rank {other} had "
                    f"finished the program. " + collective
                )
            if time.monotonic() - start < slice_ / 2:
                # The store did not answer: rank 0 is gone. Retry until the
                # deadline (torch's watchdog stops this rank sooner).
                time.sleep(slice_ / 2)
        if called != name:
            raise KerasDistError(
                f"Rank {me} called `{name}` while rank {other} called "
                f"`{called}` (their call {number}). " + collective
            )


def log(message: str) -> None:
    """Writes `message` to stderr, prefixed with keras_dist, and flushes."""
    sys.stderr.write(f"keras_dist: {message}\n")
    sys.stderr.flush()


def describe_exit(returncode: int) -> str:
    """Returns ``"exited with code 3"`` or ``"was killed by SIGKILL"``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def exit_status(returncode: int) -> int:
    """A child's return code as this process's exit code: the code
    itself, or 128 + N for a child killed by signal N (as a shell does)."""
    return returncode if returncode >= 0 else 128 - returncode


def stop_processes(procs, grace: float) -> None:
    """Stops every live process of `procs` and waits for all of them.

    Each gets SIGTERM, and SIGKILL if it still runs `grace` seconds after
    (at once for ``grace <= 0``).

    Args:
        procs: `subprocess.Popen` objects (any iterable).
        grace: seconds between SIGTERM and SIGKILL.
    """
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        if grace > 0:
            proc.terminate()
        else:
            proc.kill()
    deadline = time.monotonic() + grace
    for proc in live:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def watch_processes(procs: dict, decide, interval: float, stop=None):
    """Polls `procs` until `decide` gives a result; returns it.

    Args:
        procs: ``{key: Popen}``.
        decide: called every `interval` seconds with ``{key: returncode}``
            (None for a process still running); returns None to go on
            watching, or the result (an exit code, a message).
        interval: seconds between polls.
        stop: an optional `threading.Event`; once set, the watch ends and
            returns None.
    """
    while stop is None or not stop.is_set():
        result = decide({key: proc.poll() for key, proc in procs.items()})
        if result is not None:
            return result
        time.sleep(interval)
    return None


def is_failure(code) -> bool:
    """Whether a child's exit code (None: still running) is a failure.

    0 and `PREEMPTION_EXIT_CODE` (stopped for preemption, with the job's
    state saved) are not.
    """
    return code is not None and code not in (0, PREEMPTION_EXIT_CODE)


class Supervisor:
    """Rank 0's watch over the child processes it started.

    A child that ends with a non-zero code (or a signal) while rank 0 still
    runs is a failure of that rank: the supervisor reports it through
    `report` (so that the other ranks stop), terminates the remaining
    children and ends rank 0 with a non-zero exit code. At a normal exit of
    rank 0 it waits for the children and exits non-zero if one failed.
    Children that exit with `PREEMPTION_EXIT_CODE` stopped for preemption
    (not a failure): rank 0 then exits with that code too.

    Args:
        children: ``{rank: Popen}`` of the started processes.
        report: called with an error line before stopping; may be None.
        exit_timeout: seconds to wait for children at a normal exit.
    """

    def __init__(self, children: dict, report=None, exit_timeout=60.0):
        self.children = dict(children)
        self.report = report
        self.exit_timeout = exit_timeout
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="keras_dist-supervisor", daemon=True
        )

    def start(self) -> Supervisor:
        """Starts the watch thread and the exit handler; returns self."""
        self._thread.start()
        atexit.register(self.wait_at_exit)
        return self

    def _watch(self) -> None:
        def first_failure(codes):
            for rank, code in codes.items():
                if is_failure(code):
                    return f"rank {rank} {describe_exit(code)}"
            return None

        failure = watch_processes(
            self.children, first_failure, POLL_SECONDS, self._stopping
        )
        if failure is not None:
            self.fail(failure)

    def terminate_children(self, grace: float = 5.0) -> None:
        """Sends SIGTERM to live children, then SIGKILL after `grace` s."""
        stop_processes(self.children.values(), grace)

    def fail(self, message: str) -> None:
        """Reports `message`, stops every child and ends this process."""
        self._stopping.set()
        first = message
        if self.report is not None:
            try:
                first = self.report(message) or message
            except Exception:  # noqa: BLE001 - the store may be gone.
                pass
        log(f"stopping all ranks: {first}")
        self.terminate_children()
        os._exit(EXIT_CODE)

    def wait_at_exit(self) -> None:
        """Waits for the children at rank 0's exit; kills stragglers."""
        self._stopping.set()
        if self._thread is not threading.current_thread():
            # A watch thread in `fail` ends the process itself; one still
            # polling stops within POLL_SECONDS. Either way it must not be
            # running when the interpreter finalizes (see `Watchdog`).
            self._thread.join(self.exit_timeout)
        deadline = time.monotonic() + self.exit_timeout
        failed = []
        preempted = []
        for rank, proc in self.children.items():
            try:
                code = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(
                    f"rank {rank} did not finish within "
                    f"{self.exit_timeout:.0f} s of rank 0; stopping it."
                )
                code = None
            if code == PREEMPTION_EXIT_CODE:
                preempted.append(rank)
            elif code != 0:
                failed.append(rank)
        self.terminate_children()
        if failed:
            codes = ", ".join(
                f"rank {r} {describe_exit(self.children[r].returncode)}"
                for r in failed
            )
            log(f"training failed on other ranks: {codes}")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(EXIT_CODE)
        if preempted:
            # The ranks stopped together for preemption: so does the job.
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(PREEMPTION_EXIT_CODE)


class Watchdog:
    """Stops this process when another rank fails or the launcher dies.

    Polls, every `POLL_SECONDS`: the parent process id (a changed one means
    the launcher died), and `check_error()` (returns the first failure
    reported by any rank, or None; raising means the store is gone, i.e.
    rank 0 died). On a failure it runs `on_stop` (e.g. stop child
    processes), prints the failing rank's error and ``os._exit``\\ s.

    `stop` must run before the interpreter finalizes (the backend calls it
    from its exit handler): a daemon thread that is inside a store call
    when Python finalizes is ended by ``pthread_exit``, and unwinding
    through the binding's GIL guard aborts the process ("terminate called
    without an active exception").

    Args:
        rank: this process's rank (for messages).
        check_error: returns a reported failure line or None.
        watch_parent: whether a change of parent ends this process.
        on_stop: optional callable run before exiting.
    """

    def __init__(self, rank, check_error, watch_parent, on_stop=None):
        self.rank = rank
        self.check_error = check_error
        self.watch_parent = watch_parent
        self.on_stop = on_stop
        self.parent = os.getppid()
        self.stopped = threading.Event()
        self.muted = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="keras_dist-watchdog", daemon=True
        )

    def start(self) -> Watchdog:
        """Starts the watch thread; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the watch and waits for its thread (at a normal exit)."""
        self.muted.set()
        self.stopped.set()
        thread = self._thread
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout)

    def _watch(self) -> None:
        lost_since = None
        while not self.stopped.wait(POLL_SECONDS):
            if self.watch_parent and os.getppid() != self.parent:
                self._stop("the launcher process (rank 0) died")
            try:
                error = self.check_error()
                lost_since = None
            except Exception:  # noqa: BLE001 - store unreachable.
                if self.muted.is_set():
                    return
                # Rank 0 may have just finished normally while this rank
                # tears down: only a store gone for a while means a death.
                now = time.monotonic()
                lost_since = now if lost_since is None else lost_since
                if now - lost_since >= STORE_LOSS_SECONDS:
                    self._stop(
                        "lost contact with rank 0 (its rendezvous store is "
                        "gone, so rank 0 died or exited)"
                    )
                continue
            if error and not error.startswith(f"rank {self.rank}:"):
                # Another rank failed and is exiting: let it go first, so
                # that the launcher names it (it stops this one sooner).
                self._stop(error, grace=PEER_FAILURE_GRACE)

    def _stop(self, reason: str, grace: float = 0.0) -> None:
        if self.muted.is_set():
            return
        log(f"rank {self.rank} stopping because {reason}")
        if self.on_stop is not None:
            try:
                self.on_stop(reason)
            except Exception:  # noqa: BLE001
                pass
        sys.stdout.flush()
        if grace:
            time.sleep(grace)
        os._exit(EXIT_CODE)


class ProgressWatchdog:
    """Ends the process when a call makes no progress for `timeout` s.

    For engines whose collectives have no timeout of their own (XLA's CPU
    collectives on several JAX processes): a worker that hangs (alive, so
    no heartbeat notices) would leave the others waiting in a collective
    forever. The engine calls `progress()` at every step and `stop()` when
    the call ends; after `timeout` seconds without progress the process
    exits with `EXIT_CODE`, which stops the job (its launcher stops the
    other workers).

    Args:
        rank: this process's rank (for the message).
        timeout: seconds without progress before the process exits.
    """

    def __init__(self, rank: int, timeout: float):
        self.rank = rank
        self.timeout = timeout
        self._last = time.monotonic()
        self._armed = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="keras_dist-progress", daemon=True
        )

    def start(self) -> ProgressWatchdog:
        """Starts watching; returns self."""
        self._last = time.monotonic()
        self._thread.start()
        return self

    def progress(self) -> None:
        """Records that a step started or finished. The watch is armed at
        the first call: compiling the first step may take long."""
        self._last = time.monotonic()
        self._armed = True

    def stop(self) -> None:
        """Ends the watch and waits for its thread."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(max(1.0, POLL_SECONDS * 4))

    def _watch(self) -> None:
        while not self._stopped.wait(min(POLL_SECONDS, self.timeout / 4)):
            idle = time.monotonic() - self._last
            if self._armed and idle > self.timeout:
                log(
                    f"rank {self.rank} stopping: no step finished for "
                    f"{idle:.0f} s (KERAS_DIST_TIMEOUT={self.timeout:.0f}); "
                    "another worker is hung or dead."
                )
                sys.stdout.flush()
                os._exit(EXIT_CODE)
