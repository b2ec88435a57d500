"""Noticing a preemption signal and agreeing on the step to stop at.

The signal handler only records the signal; the training thread checks the
record after each step. With several processes they agree through one
all-reduce (max) of ``[signalled, step, -step]`` per step, so that a signal
that reached only one process (e.g. torch's rank 0, the launcher) stops all
of them after the same step: the largest step any process reached (plus
one if they differ). One process needs no collective at all.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings

import numpy as np

from keras_dist._src.cluster.supervision import PREEMPTION_EXIT_CODE

# PREEMPTION_EXIT_CODE (75) is ``EX_TEMPFAIL`` of ``sysexits.h`` ("temporary
# failure; the user is invited to retry"): the job did nothing wrong and
# should run again, so schedulers can tell it from a failure (exit 1) and
# requeue it. The launcher's supervisor passes it through.


class SignalWatcher:
    """Records preemption signals while `fit` runs; chains otherwise.

    Installed at the start of `fit` and removed at its end (the previous
    handlers come back). A signal that arrives when the recorded `fit` is
    no longer on the main thread's stack (it raised) goes to the previous
    handler, so a failed `fit` never leaves the process deaf to SIGTERM.

    Args:
        signals: the signals to watch.
    """

    def __init__(self, signals):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received = None  # the first signal's number
        self.received_at = None  # time.monotonic() when it came
        self._previous = {}
        self._fit_frame = None

    @property
    def installed(self) -> bool:
        """Whether the handlers are in place."""
        return bool(self._previous)

    def install(self, fit_frame=None) -> bool:
        """Installs the handlers (main thread only).

        Args:
            fit_frame: the frame of the running `fit`, if known.

        Returns:
            Whether they were installed (not outside the main thread).
        """
        self.uninstall()
        self.received = self.received_at = None
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "BackupAndRestore cannot watch preemption signals: `fit` "
                "runs outside the main thread. Periodic saves still happen.",
                stacklevel=3,
            )
            return False
        self._fit_frame = (
            (id(fit_frame), fit_frame.f_code) if fit_frame else None
        )
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        """Puts the previous handlers back."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            try:
                signal.signal(sig, handler if handler is not None else 0)
            except (ValueError, TypeError):  # not the main thread
                pass
        self._fit_frame = None

    def _in_fit(self, frame) -> bool:
        if self._fit_frame is None:
            return True
        wanted_id, wanted_code = self._fit_frame
        while frame is not None:
            if id(frame) == wanted_id and frame.f_code is wanted_code:
                return True
            frame = frame.f_back
        return False

    def _handle(self, signum, frame) -> None:
        if not self._in_fit(frame):
            previous = self._previous.get(signum)
            self.uninstall()
            _deliver(signum, frame, previous)
            return
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if self.received is None:
            self.received = signum
            self.received_at = time.monotonic()


def _deliver(signum, frame, previous) -> None:
    """Handles `signum` the way the previous handler would have."""
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    elif signum == signal.SIGINT:
        raise KeyboardInterrupt
    else:
        os.kill(os.getpid(), signum)  # the default action, now restored


def signal_name(signum) -> str:
    """``"SIGTERM"`` for 15."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Agreement:
    """Decides, after each step, whether every process stops now.

    Args:
        runtime: the job's `Runtime`.
        watcher: the `SignalWatcher` of this process.
    """

    def __init__(self, runtime, watcher):
        self.runtime = runtime
        self.watcher = watcher
        self.stop_at = None

    def should_stop(self, step: int, agree: bool = True) -> bool:
        """Whether to stop after `step`.

        Args:
            step: the global step just finished.
            agree: whether the processes agree now (a collective when
                world_size > 1; every process must pass the same value).
        """
        if self.stop_at is None:
            signalled = int(self.watcher.received is not None)
            if self.runtime.world_size == 1:
                if signalled:
                    self.stop_at = step
            elif agree:
                packed = np.array([signalled, step, -step], np.int64)
                flag, high, neg_low = self.runtime.all_reduce(packed, "max")
                if flag:
                    self.stop_at = int(high) + (int(high) != -int(neg_low))
        return self.stop_at is not None and step >= self.stop_at


class GraceTimer:
    """Ends the process if it has not exited `seconds` after the signal.

    A daemon thread polls the watcher; past the grace period it exits with
    `PREEMPTION_EXIT_CODE` at once (the last complete checkpoint remains,
    a save in progress stays invisible).
    """

    def __init__(self, watcher, seconds, poll=0.2):
        self.watcher = watcher
        self.seconds = seconds
        self.poll = poll
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> GraceTimer:
        """Starts watching (a no-op without a grace period)."""
        if self.seconds is None:
            return self
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name="keras_dist-preemption", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops watching."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            since = self.watcher.received_at
            if since is not None and time.monotonic() - since > self.seconds:
                sys.stderr.write(
                    f"keras_dist: no checkpoint was completed within the "
                    f"grace period of {self.seconds:g} s after "
                    f"{signal_name(self.watcher.received)}; exiting with "
                    f"code {PREEMPTION_EXIT_CODE} (the previous checkpoint "
                    "is kept).\n"
                )
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(PREEMPTION_EXIT_CODE)
