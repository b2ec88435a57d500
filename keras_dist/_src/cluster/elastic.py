"""Restarts and elastic membership across nodes for ``keras-dist launch``.

With ``--nnodes N`` (N > 1) and ``--max-restarts``, or ``--nnodes MIN:MAX``,
the launchers of a job meet at a rendezvous that node 0's launcher serves
on ``--master-addr:--master-port`` (a `multiprocessing.managers` server:
the standard library's remote objects). Each *round* of the job:

1. every launcher joins; node 0's launcher forms the round once MAX nodes
   have joined, or once the round's deadline (``--rdzv-timeout``, default
   `DEFAULT_RDZV_TIMEOUT_S`) has passed with at least MIN, and picks a
   fresh port for the workers' own rendezvous (no stale coordinator);
   node ranks are given in ``--node-rank`` order, node 0 first;
2. every launcher starts its workers with the round's ``WORLD_SIZE``,
   ranks and ``MASTER_PORT``, and ``KERAS_DIST_RESTART_COUNT`` = the round;
3. a node whose workers fail (a crash, a kill, a hang, a preemption) says
   so at once, and every other node stops its workers; a launcher that
   stops sending heartbeats for `LOST_S` seconds (its host died, it was
   killed) counts as failed too;
4. node 0's launcher decides, as one node's launcher does (`restarts`):
   done, or restart (up to ``--max-restarts``; two failures in a row of
   the script itself at one step stop the restarts), and every launcher
   ends with the decided code or joins the next round.

A lost node that does not come back within the deadline is left out: the
next round runs on the nodes left if they are at least MIN, and
``BackupAndRestore`` restores the checkpoint into the smaller replica
count; the global batch stays the same (each replica takes a larger
share). A launcher that starts while a round runs joins the next round.
Node 0's launcher is the rendezvous: if it is lost, the job ends.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
import threading
import time
from multiprocessing import managers

from keras_dist._src.cluster import restarts
from keras_dist._src.cluster.supervision import log

#: Seconds between a launcher's heartbeats.
BEAT_S = 1.0
#: Seconds without a heartbeat after which a launcher counts as lost.
LOST_S = 10.0
#: How long a round waits for nodes, when ``--rdzv-timeout`` is not given.
DEFAULT_RDZV_TIMEOUT_S = 300.0
POLL_S = 0.2


class Board:
    """Node 0's record of the job, served to every launcher.

    Each method is one short call under a lock (the server runs each
    client's calls in a thread of its own)."""

    def __init__(self, min_nodes: int, max_nodes: int, timeout: float):
        self._lock = threading.Lock()
        self._min, self._max, self._timeout = min_nodes, max_nodes, timeout
        self._round = 0
        self._opened = {0: time.monotonic()}  # round -> when it opened
        self._target = {0: max_nodes}  # round -> nodes it waits for
        self._joined: dict = {0: {}}  # round -> {key: requested rank}
        self._plans: dict = {}  # round -> {"members": [...], "port": p}
        self._failures: dict = {}  # round -> first failure's description
        self._reports: dict = {}  # round -> {key: summary}
        self._verdicts: dict = {}  # round -> {"restart", "code", "message"}
        self._seen: dict = {}  # round -> keys that read the verdict
        self._beats: dict = {}  # key -> time.monotonic()
        self._ended = None  # {"ended": code, "message": ...} once over
        self._addresses: dict = {}  # key -> its workers' host:port

    # -- called by every launcher ------------------------------------------
    def join(self, key: str, requested: int, addresses=()) -> int:
        """Joins the round being formed (or the next one, while a round
        runs) with the ``host:port`` each of this node's workers would
        serve on (TensorFlow's); returns the round's number."""
        with self._lock:
            self._beats[key] = time.monotonic()
            number = self._round + (self._round in self._plans)
            self._joined.setdefault(number, {})[key] = requested
            self._addresses[key] = list(addresses)
            return number

    def plan(self, number: int):
        """Round `number`'s plan, ``{"ended": code, "message": ...}`` when
        the job ended before it, or None while it is being formed."""
        with self._lock:
            if number in self._plans:
                return self._plans[number]
            return self._ended

    def beat(self, key: str) -> None:
        """A launcher's heartbeat."""
        with self._lock:
            self._beats[key] = time.monotonic()

    def fail(self, number: int, description: str) -> None:
        """Records round `number`'s first failure."""
        with self._lock:
            self._failures.setdefault(number, description)

    def failure(self, number: int) -> str:
        """Round `number`'s first failure ("" while none): a node's failed
        workers, or a launcher lost."""
        with self._lock:
            if number not in self._failures:
                for key in self._lost(number):
                    if key not in self._reports.get(number, {}):
                        self._failures[number] = (
                            f"the launcher of node {self._node(number, key)} "
                            f"({key}) was lost: no heartbeat for {LOST_S:g} s"
                        )
                        break
            return self._failures.get(number, "")

    def report(self, number: int, key: str, summary: dict) -> None:
        """How round `number` ended on the node of `key`."""
        with self._lock:
            self._reports.setdefault(number, {})[key] = summary

    def verdict(self, number: int, key: str):
        """Round `number`'s verdict (None while undecided)."""
        with self._lock:
            verdict = self._verdicts.get(number)
            if verdict is not None:
                self._seen.setdefault(number, set()).add(key)
            return verdict

    # -- node 0 only ---------------------------------------------------------
    def form(self, number: int, port_for) -> dict:
        """Waits until round `number` can start and returns its plan."""
        while True:
            with self._lock:
                joined = self._joined.get(number, {})
                late = time.monotonic() - self._opened[number] > self._timeout
                if len(joined) >= min(self._target[number], self._max) or (
                    late and len(joined) >= self._min
                ):
                    order = sorted(joined, key=lambda k: (joined[k], k))
                    members = order[: self._max]
                    plan = {
                        "members": members,
                        "port": port_for(),
                        "addresses": [
                            a for k in members for a in self._addresses[k]
                        ],
                    }
                    self._plans[number] = plan
                    return plan
                if late:
                    message = (
                        f"only {len(joined)} node(s) joined within the "
                        f"rendezvous timeout of {self._timeout:g} s; "
                        f"--nnodes asks for at least {self._min}"
                    )
                    self._ended = {"ended": 1, "message": message}
                    return self._ended
            time.sleep(POLL_S)

    def decide(self, number: int, decide_outcomes) -> dict:
        """Waits for every member's report (or its loss), then records and
        returns ``decide_outcomes(summaries, lost)``'s verdict; opens the
        next round when it is a restart."""
        members = self._plans[number]["members"]
        while True:
            with self._lock:
                reports = dict(self._reports.get(number, {}))
                lost = [
                    k
                    for k in self._lost(number)
                    if k not in reports and k in members
                ]
                if len(reports) + len(lost) >= len(members):
                    break
            time.sleep(POLL_S)
        verdict = decide_outcomes(
            [reports[k] for k in members if k in reports], lost
        )
        with self._lock:
            self._verdicts[number] = verdict
            if not verdict["restart"]:
                self._ended = {
                    "ended": verdict["code"],
                    "message": "the job ended before this node joined",
                }
            else:
                leaving = [k for k, r in reports.items() if r.get("leaving")]
                self._round = number + 1
                self._opened[number + 1] = time.monotonic()
                self._target[number + 1] = len(members) - len(leaving)
                self._joined.setdefault(number + 1, {})
        return verdict

    def wait_seen(self, number: int, key: str, seconds: float) -> None:
        """Waits (at most `seconds`) until every live member but `key` read
        round `number`'s verdict, so that none is left waiting for it."""
        end = time.monotonic() + seconds
        members = set(self._plans[number]["members"]) - {key}
        while time.monotonic() < end:
            with self._lock:
                live = members - set(self._lost(number))
                if live <= self._seen.get(number, set()):
                    return
            time.sleep(POLL_S)

    def _lost(self, number: int) -> list:
        now = time.monotonic()
        members = self._plans.get(number, {}).get("members", [])
        return [k for k in members if now - self._beats.get(k, now) > LOST_S]

    def _node(self, number: int, key: str) -> int:
        return self._plans[number]["members"].index(key)


class _Manager(managers.BaseManager):
    pass


def _authkey(addr: str, port: int) -> bytes:
    return f"keras_dist rendezvous {addr}:{port}".encode()


def serve(board: Board, addr: str, port: int):
    """Serves `board` on ``addr:port`` from a daemon thread."""

    class Server(_Manager):
        pass

    Server.register("board", callable=lambda: board)
    server = Server((addr, port), _authkey(addr, port)).get_server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def connect(addr: str, port: int, timeout: float):
    """A proxy of node 0's `Board`; retries until node 0's launcher serves
    it, at most `timeout` seconds.

    Raises:
        ConnectionError: when it does not within `timeout`.
    """

    class Client(_Manager):
        pass

    Client.register("board")
    end = time.monotonic() + timeout
    while True:
        manager = Client((addr, port), _authkey(addr, port))
        try:
            manager.connect()
            return manager.board()
        except OSError as error:
            if time.monotonic() > end:
                raise ConnectionError(
                    f"no rendezvous on {addr}:{port} within {timeout:g} s "
                    f"({error}): start node 0's launcher (--node-rank 0) "
                    "with the same --master-addr and --master-port."
                ) from error
            time.sleep(POLL_S * 5)


@dataclasses.dataclass
class Nodes:
    """How `run` meets the other nodes (from ``keras-dist launch``)."""

    min_nodes: int
    max_nodes: int
    node_rank: int
    addr: str
    port: int
    timeout: float = DEFAULT_RDZV_TIMEOUT_S


def run(nodes: Nodes, policy, start_round, local_ranks) -> int:
    """Runs rounds of the job on this node until node 0 decides it ended.

    Args:
        nodes: the rendezvous and membership settings.
        policy: the `restarts.RestartPolicy`.
        start_round: ``start_round(node_rank, nnodes, port, addresses,
            extra_env, supervise)`` starts this node's workers (`addresses`:
            every worker's ``host:port`` for TensorFlow's servers, in rank
            order) and returns what ``supervise({rank: Popen})`` returned.
        local_ranks: ``local_ranks(node_rank, nnodes)``: this node's
            ranks in a round.

    Returns:
        The job's exit code, as node 0 decided it.
    """
    host = nodes.node_rank == 0
    key = f"{socket.gethostname()}:{os.getpid()}"
    if host:
        board = Board(nodes.min_nodes, nodes.max_nodes, nodes.timeout)
        serve(board, nodes.addr, nodes.port)
        beats = board
    else:
        board = connect(nodes.addr, nodes.port, nodes.timeout)
        beats = connect(nodes.addr, nodes.port, nodes.timeout)
    stop_beats = threading.Event()

    def beat():
        while not stop_beats.wait(BEAT_S):
            try:
                beats.beat(key)
            except (OSError, EOFError):
                return

    threading.Thread(target=beat, daemon=True).start()
    directory = None
    if policy.reports:
        directory = tempfile.mkdtemp(prefix="keras_dist_progress_")
    history = []  # each decided round's leading summary
    try:
        while True:
            number = board.join(
                key, nodes.node_rank, _worker_addresses(nodes, local_ranks)
            )
            if host:
                plan = board.form(number, _port_for(nodes.addr))
            else:
                plan = _wait(lambda n=number: board.plan(n))
            if "ended" in plan:
                log(f"not starting: {plan['message']}.")
                return plan["ended"]
            members = plan["members"]
            node_rank = members.index(key)
            log(
                f"round {number}: node {node_rank} of {len(members)} "
                f"(workers' rendezvous on port {plan['port']})."
            )
            if host and len(members) < nodes.max_nodes:
                log(
                    f"the job goes on with {len(members)} of "
                    f"{nodes.max_nodes} nodes (--nnodes "
                    f"{nodes.min_nodes}:{nodes.max_nodes}; no more joined "
                    f"within --rdzv-timeout {nodes.timeout:g} s); a node "
                    "that starts again joins at the next restart."
                )
            ranks = local_ranks(node_rank, len(members))
            env, progress_board = restarts.attempt_setup(
                policy, directory, number, ranks
            )
            signalled = []
            remote = _Remote(board, number)

            def supervise(procs, b=progress_board, s=signalled, r=remote):
                return restarts.supervise_attempt(procs, b, policy, s, r)

            outcome = start_round(
                node_rank,
                len(members),
                plan["port"],
                plan["addresses"],
                env,
                supervise,
            )
            board.report(number, key, _summary(outcome, signalled))
            if host:

                def decide(summaries, lost, outcome=outcome, s=signalled):
                    if s:  # node 0's launcher was stopped: the job ends
                        return {
                            "restart": False,
                            "code": outcome.code,
                            "message": "node 0's launcher was stopped from "
                            f"outside; the job ends ({outcome.describe()}).",
                        }
                    return _decide(summaries, lost, policy, history)

                verdict = board.decide(number, decide)
            else:
                verdict = _wait(lambda n=number: board.verdict(n, key))
            log(verdict["message"])
            if not verdict["restart"] or signalled:
                if host:
                    board.wait_seen(number, key, LOST_S)
                return verdict["code"] if not signalled else outcome.code
            time.sleep(verdict.get("delay", 0.0))
    except (EOFError, ConnectionError, BrokenPipeError) as error:
        log(
            f"lost the rendezvous on node 0 ({error!r}): node 0's launcher "
            "ended; stopping."
        )
        return 1
    finally:
        stop_beats.set()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


class _Remote:
    """What `restarts.supervise_attempt` asks at each poll: another node's
    failure; and where it reports this node's."""

    def __init__(self, board, number):
        self.board, self.number = board, number

    def __call__(self) -> str:
        try:
            return self.board.failure(self.number)
        except (OSError, EOFError) as error:
            return f"the rendezvous on node 0 is gone ({error!r})"

    def failed(self, description: str) -> None:
        try:
            self.board.fail(self.number, description)
        except (OSError, EOFError):
            pass


def _worker_addresses(nodes: Nodes, local_ranks) -> list:
    """A free ``host:port`` on this node for each of its workers (where
    TensorFlow's workers serve), on the address that reaches node 0."""
    from keras_dist._src.cluster.launcher import free_port

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((nodes.addr, nodes.port))  # sends nothing
        host = probe.getsockname()[0]
    return [f"{host}:{free_port(host)}" for _ in local_ranks(0, 1)]


def _port_for(addr):
    from keras_dist._src.cluster.launcher import free_port

    return lambda: free_port(addr)


def _wait(ask):
    while True:
        answer = ask()
        if answer is not None:
            return answer
        time.sleep(POLL_S)


def _summary(outcome, signalled) -> dict:
    return {
        "kind": outcome.kind,
        "code": outcome.code,
        "rank": outcome.rank,
        "returncode": outcome.returncode,
        "where": list(outcome.position.where()) if outcome.position else None,
        "at": outcome.where(),
        "describe": outcome.describe(),
        "leaving": bool(signalled),
    }


def _decide(summaries, lost, policy, history) -> dict:
    """Node 0's verdict on a round (see the module's docstring)."""
    if not lost and all(s["kind"] == "ok" for s in summaries):
        restarted = len(history)
        message = "the job succeeded" + (
            f" after {restarted} restart(s)." if restarted else "."
        )
        return {"restart": False, "code": 0, "message": message}
    order = ("failed", "hung", "preempted", "stopped")
    ranked = sorted(
        (s for s in summaries if s["kind"] != "ok"),
        key=lambda s: order.index(s["kind"]),
    )
    if lost:  # the others' failures follow from it
        lead = {
            "kind": "lost",
            "code": 1,
            "where": None,
            "describe": f"{len(lost)} node launcher(s) lost (no heartbeat "
            f"for {LOST_S:g} s)",
        }
    else:
        lead = ranked[0]
    restart = len(history)
    previous = history[-1] if history else None
    history.append(lead)
    what = lead["describe"]
    if any(s["leaving"] and s["kind"] != "ok" for s in summaries):
        what += " (a launcher was stopped from outside: it leaves the job)"
    if restart == policy.max_restarts:
        return {
            "restart": False,
            "code": lead["code"],
            "message": (
                f"{what}; no restart left (all {policy.max_restarts} used). "
                f"Exiting with code {lead['code']}."
            ),
        }
    if previous is not None and _internal(previous) and _internal(lead):
        if previous["where"] and previous["where"] == lead["where"]:
            return {
                "restart": False,
                "code": lead["code"],
                "message": (
                    f"workers failed twice {lead['at']} (exit "
                    f"{lead['code']}): that looks like a bug in the "
                    "script, not a fault; not restarting. Exiting with "
                    f"code {lead['code']}."
                ),
            }
    delay = min(policy.backoff * 2**restart, restarts.BACKOFF_CAP_S)
    return {
        "restart": True,
        "code": lead["code"],
        "delay": delay,
        "message": (
            f"{what}; restart {restart + 1} of {policy.max_restarts} of the "
            f"whole job in {delay:.1f} s."
        ),
    }


def _internal(summary) -> bool:
    outcome = restarts.Outcome(
        summary["code"],
        summary["kind"] if summary["kind"] != "lost" else "stopped",
        summary.get("rank"),
        summary.get("returncode"),
    )
    return outcome.internal()
