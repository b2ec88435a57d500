"""Restarts and hang detection for ``keras-dist launch``.

`run` starts the node's workers (one *attempt*), watches them until the
attempt ends, and starts the whole node again after a failure, up to
``--max-restarts`` times, with a doubling back-off. Every attempt gets a
fresh rendezvous (the launcher picks new free ports) and
``KERAS_DIST_RESTART_COUNT``. With ``--max-restarts`` or a hang timeout the
workers report their progress (`progress.ProgressBoard`), which tells:

* where a failed worker was: two failures in a row at the same step (an
  exception, a crash or a hang, not a kill from outside or a preemption)
  are a bug in the script, not a fault, and stop the restarts;
* which worker stopped making progress: past the hang timeout (the
  start-up timeout before a worker's first step) every worker dumps its
  Python stack, the launcher names the worker(s) behind and ends the
  attempt with `HANG_EXIT_CODE`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
import time

from keras_dist._src.cluster import progress
from keras_dist._src.cluster.supervision import (
    PREEMPTION_EXIT_CODE,
    describe_exit,
    exit_status,
    log,
    stop_processes,
)

#: The exit code of a job ended by the hang timeout (as ``timeout(1)``).
HANG_EXIT_CODE = 124
#: The longest wait between restarts, in seconds.
BACKOFF_CAP_S = 30.0
#: Seconds the launcher waits for the workers' stacks after asking.
STACK_WAIT_S = 2.0
#: The start-up timeout, when not given: this many hang timeouts...
STARTUP_FACTOR = 10
#: ... and at least this many seconds.
STARTUP_MIN_S = 300.0
POLL_S = 0.2
#: Seconds between SIGTERM and SIGKILL for the other workers after a
#: failure when a restart may follow: they cannot save without the failed
#: worker (a checkpoint is complete or invisible, so a kill is safe), and
#: each second is a second of the restart.
RESTART_STOP_GRACE_S = 3.0
#: Exits that come from outside the script (a kill, a preemption): never
#: taken for a bug, however often they repeat.
_OUTSIDE_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)


@dataclasses.dataclass
class RestartPolicy:
    """How `run` restarts and watches a node's workers.

    Args:
        max_restarts: restarts after a failure, hang or preemption.
        backoff: seconds before the first restart; doubles each time,
            at most `BACKOFF_CAP_S`.
        hang_timeout: seconds without progress after a worker's first
            step that end the attempt; None: not watched.
        startup_timeout: seconds a worker may take to its first step;
            None: `STARTUP_FACTOR` hang timeouts, at least
            `STARTUP_MIN_S` (not watched without a hang timeout).
    """

    max_restarts: int = 0
    backoff: float = 1.0
    hang_timeout: float | None = None
    startup_timeout: float | None = None

    def check(self) -> None:
        """Raises ValueError for settings that cannot hold."""
        if self.max_restarts < 0:
            raise ValueError(
                f"--max-restarts {self.max_restarts}: give 0 or more."
            )
        if not 0 <= self.backoff < float("inf"):
            raise ValueError(
                f"--restart-backoff {self.backoff}: give 0 or more seconds."
            )
        for name, value in (
            ("--hang-timeout", self.hang_timeout),
            ("--startup-timeout", self.startup_timeout),
        ):
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} {value}: give a positive number.")

    @property
    def startup(self) -> float | None:
        """The start-up timeout in force."""
        if self.startup_timeout is not None:
            return self.startup_timeout
        if self.hang_timeout is None:
            return None
        return max(STARTUP_FACTOR * self.hang_timeout, STARTUP_MIN_S)

    @property
    def reports(self) -> bool:
        """Whether workers report their progress."""
        return bool(self.max_restarts) or self.startup is not None


@dataclasses.dataclass
class Outcome:
    """How one attempt ended."""

    code: int  # the launcher's exit code if it ends here
    #: "ok", "preempted", "failed", "hung" or "stopped" (by another node's
    #: failure, `detail` says which).
    kind: str
    rank: int | None = None
    returncode: int | None = None
    position: progress.Position | None = None
    detail: str = ""

    def internal(self) -> bool:
        """Whether the script itself failed (an exception, a crash, a
        hang): not a preemption or a kill from outside."""
        if self.kind == "hung":
            return True
        if self.kind != "failed" or self.returncode is None:
            return False
        return self.returncode > 0 or -self.returncode not in [
            int(s) for s in _OUTSIDE_SIGNALS
        ]

    def where(self) -> str:
        """``"at step 12"``, or ``""`` when unknown."""
        if self.position is None:
            return ""
        described = self.position.describe()
        return described if "before" in described else f"at {described}"

    def describe(self) -> str:
        """``"worker rank 1 was killed by SIGKILL at step 7"``."""
        if self.kind == "preempted":
            return "workers stopped for preemption (exit 75)"
        if self.kind == "stopped":
            return self.detail
        what = (
            "hung"
            if self.kind == "hung"
            else describe_exit(self.returncode or 0)
        )
        where = self.where()
        return f"worker rank {self.rank} {what}" + (
            f" {where}" if where else ""
        )


def run(start_attempt, policy: RestartPolicy, ranks) -> int:
    """Runs attempts of the node's job until one succeeds, a failure is
    not to be restarted, or the restarts are used up.

    Args:
        start_attempt: ``start_attempt(extra_env, supervise)`` starts the
            workers with `extra_env` added to their environment, calls
            ``supervise({rank: Popen})`` and returns what it returned (an
            `Outcome`) once every worker is stopped.
        policy: the `RestartPolicy`.
        ranks: the ranks of this node's workers.

    Returns:
        The launcher's exit code: 0, the failed worker's code (128 + N
        for signal N), `PREEMPTION_EXIT_CODE` or `HANG_EXIT_CODE`.
    """
    policy.check()
    directory = None
    if policy.reports:
        directory = tempfile.mkdtemp(prefix="keras_dist_progress_")
    previous = None
    try:
        for restart in range(policy.max_restarts + 1):
            env, board = attempt_setup(policy, directory, restart, ranks)
            signalled = []

            def supervise(procs, board=board, signalled=signalled):
                return supervise_attempt(procs, board, policy, signalled)

            outcome = start_attempt(env, supervise)
            if outcome.kind == "ok":
                if restart:
                    log(f"the job succeeded after {restart} restart(s).")
                return 0
            if signalled:
                if policy.max_restarts:
                    log(
                        f"not restarting: the launcher got "
                        f"{signal.Signals(signalled[0]).name} (stop asked "
                        "from outside)."
                    )
                return outcome.code
            if restart == policy.max_restarts:
                if policy.max_restarts:
                    log(
                        f"{outcome.describe()}; no restart left (all "
                        f"{policy.max_restarts} used). Exiting with code "
                        f"{outcome.code}."
                    )
                return outcome.code
            if _repeated(previous, outcome):
                what = "hung" if outcome.kind == "hung" else "failed"
                who = f"worker rank {outcome.rank}"
                if previous.rank != outcome.rank:
                    who = (
                        f"workers (rank {previous.rank}, then rank "
                        f"{outcome.rank})"
                    )
                log(
                    f"{who} {what} twice "
                    f"{outcome.where()} ({_exit_words(outcome)}): that "
                    "looks like a bug in the script, not a fault; not "
                    f"restarting. Exiting with code {outcome.code}."
                )
                return outcome.code
            delay = min(policy.backoff * 2**restart, BACKOFF_CAP_S)
            log(
                f"{outcome.describe()}; restart {restart + 1} of "
                f"{policy.max_restarts} in {delay:.1f} s."
            )
            time.sleep(delay)
            previous = outcome
        raise AssertionError("unreachable")  # pragma: no cover
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def attempt_setup(policy, directory, restart, ranks):
    """The workers' extra environment for attempt `restart` and the
    `progress.ProgressBoard` that reads their reports (None when they do
    not report); `directory` is emptied of the last attempt's reports."""
    env = {progress.ENV_RESTART_COUNT: str(restart)}
    board = None
    if directory is not None:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        env[progress.ENV_PROGRESS_DIR] = directory
        board = progress.ProgressBoard(directory, ranks)
    if policy.hang_timeout is not None:
        env[progress.ENV_HANG_TIMEOUT] = f"{policy.hang_timeout:g}"
    return env, board


def _exit_words(outcome: Outcome) -> str:
    if outcome.kind == "hung":
        return f"hang timeout, exit {outcome.code}"
    return f"exit {outcome.code}"


def _repeated(previous, outcome) -> bool:
    """Whether two failures in a row are the script's own, at one step."""
    return (
        previous is not None
        and previous.internal()
        and outcome.internal()
        and previous.position is not None
        and outcome.position is not None
        and previous.position.where() == outcome.position.where()
    )


def _record_stop_signals(signalled: list) -> None:
    """Notes SIGINT/SIGTERM sent to the launcher (a stop asked from
    outside: no restart), then forwards them as `run_supervised` does."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        forward = signal.getsignal(sig)

        def record(signum, frame, forward=forward):
            signalled.append(signum)
            if callable(forward):
                forward(signum, frame)

        signal.signal(sig, record)


def supervise_attempt(procs, board, policy, signalled, remote=None) -> Outcome:
    """Watches one attempt's workers until it ends (see `run`).

    `remote`, when given, is called at every poll: a non-empty string
    (another node's failure) stops this node's workers and ends the
    attempt as ``"stopped"``; a local failure is passed to
    ``remote.failed(description)``."""
    _record_stop_signals(signalled)
    preempted = set()
    while True:
        elsewhere = remote() if remote is not None else ""
        if elsewhere:
            log(f"{elsewhere}; stopping the workers of this node.")
            stop_processes(procs.values(), RESTART_STOP_GRACE_S)
            return Outcome(1, "stopped", detail=elsewhere)
        codes = {rank: proc.poll() for rank, proc in procs.items()}
        if board is not None:
            board.poll()
        for rank, code in codes.items():
            if code == PREEMPTION_EXIT_CODE:
                # Saved and stopped for preemption: not a failure. The
                # other workers agreed on the same step and finish too.
                preempted.add(rank)
            elif code not in (None, 0):
                log(
                    f"worker rank {rank} {describe_exit(code)}; stopping "
                    "the other workers of this node."
                )
                position = _job_position(board, procs)
                outcome = Outcome(
                    exit_status(code), "failed", rank, code, position
                )
                if remote is not None:
                    remote.failed(outcome.describe())
                if policy.max_restarts or remote is not None:
                    stop_processes(procs.values(), RESTART_STOP_GRACE_S)
                return outcome
        if None not in codes.values():
            if preempted:
                return Outcome(PREEMPTION_EXIT_CODE, "preempted")
            return Outcome(0, "ok")
        if board is not None:
            stalled = board.stalled(policy.hang_timeout, policy.startup)
            if stalled:
                outcome = _hung(procs, board, stalled, policy)
                if remote is not None:
                    remote.failed(outcome.describe())
                return outcome
        time.sleep(POLL_S)


def _key(position) -> tuple:
    return (-1, -1) if position is None else position.where()


def _job_position(board, ranks):
    """The lowest position any rank reported (None: none reported): the
    last step every rank finished. Which rank the launcher sees fail
    first depends on timing (a rank stopped by another's failure may exit
    first under load); this step does not."""
    if board is None:
        return None
    positions = [board.position(r) for r in ranks]
    if all(p is None for p in positions):
        return None
    lowest = min(positions, key=_key)
    return lowest or progress.Position("start", 0, -1, -1)


def _hung(procs, board, stalled, policy) -> Outcome:
    """Dumps every worker's stacks, names the worker(s) behind, stops
    every worker (SIGKILL: a hung worker cannot save) and returns the
    attempt's outcome."""
    # In a synchronous job the others soon wait for the rank behind, and
    # the one that stalled first may be one that went ahead: name the
    # rank(s) at the lowest step among all still in `fit`.
    watched = [
        r
        for r in procs
        if board.position(r) is None or board.position(r).state != "done"
    ]
    lowest = min(_key(board.position(r)) for r in watched)
    behind = [r for r in watched if _key(board.position(r)) == lowest]
    first = board.position(behind[0])
    names = ", ".join(f"rank {r}" for r in behind)
    if first is not None and first.state == "train":
        idle = max(board.idle(r) for r in stalled)
        head = (
            f"no progress for {idle:.1f} s (hang timeout "
            f"{policy.hang_timeout:g} s, --hang-timeout or "
            f"{progress.ENV_HANG_TIMEOUT}): {names} "
            f"{'is' if len(behind) == 1 else 'are'} behind, "
            f"{_described(first)}"
        )
    else:
        head = (
            f"{names} did not finish a first training step within the "
            f"start-up timeout of {policy.startup:g} s (--startup-timeout "
            f"or {progress.ENV_STARTUP_TIMEOUT}; progress is reported by "
            "`model.fit` under a keras_dist strategy only)"
        )
    where = "; ".join(
        f"rank {rank} {_described(board.position(rank))} (last report "
        f"{board.idle(rank):.1f} s ago)"
        for rank in sorted(procs)
    )
    for proc in procs.values():
        if proc.poll() is None:
            try:
                proc.send_signal(progress.STACK_SIGNAL)
            except ProcessLookupError:
                pass
    time.sleep(STACK_WAIT_S)  # the stacks come through the output pumps
    log(
        f"{head}. Where each rank was: {where}. Every rank's Python "
        f"stack is above ({progress.STACK_SIGNAL.name}). Stopping the job "
        f"with code {HANG_EXIT_CODE}."
    )
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
    return Outcome(HANG_EXIT_CODE, "hung", behind[0], None, first)


def _described(position) -> str:
    if position is None:
        return "had not reported (not yet in `fit`)"
    if position.state == "done":
        return f"had finished `fit` ({position.describe()})"
    described = position.describe()
    return described if "before" in described else f"at {described}"
