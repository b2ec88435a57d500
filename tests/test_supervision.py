"""A job's processes cannot leak and listen only where the job needs.

Real jobs on localhost: ``keras-dist launch`` with 2 workers (every
backend) and torch's self-relaunch (``python -c``, torch only). While they
train, the listening sockets of the workers are read from ``/proc`` (their
socket inodes in ``/proc/<pid>/fd``, the addresses in ``/proc/net/tcp`` and
``tcp6``); then the launcher is killed with SIGKILL and no worker may be
left. Linux only (``/proc``, ``PR_SET_PDEATHSIG``).
"""

import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import keras
import pytest

BACKEND = keras.backend.backend()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc (Linux)"
)

# Trains a few steps (so that every collective and store is up), records
# its pid, its rank and TensorFlow's server address, then waits to be
# killed (at most 600 s).
TRAIN_THEN_WAIT = """
import json, os, sys, time
import keras, numpy as np
import keras_dist

strategy = keras_dist.{strategy}()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.zeros((32, 4), "float32")
model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
rank = int(os.environ.get("RANK", "0"))
tf_config = json.loads(os.environ.get("TF_CONFIG") or "{{}}")
workers = tf_config.get("cluster", {{}}).get("worker") or []
server = workers[rank] if workers else None
record = {{"pid": os.getpid(), "rank": rank, "server": server}}
path = os.path.join({folder!r}, f"ready{{rank}}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
time.sleep(600)
"""


def _clean_env():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TF_CONFIG")
        and not k.startswith(("MASTER_", "KERAS_DIST_", "TORCHELASTIC_"))
        and k != "XLA_FLAGS"
    }
    env.update(KERAS_BACKEND=BACKEND, OMP_NUM_THREADS="1")
    return env


def _decode(hex_address: str) -> tuple[str, int]:
    """``/proc/net/tcp{,6}``'s ``0100007F:1F90`` as ``("127.0.0.1", 8080)``."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # Each 32-bit word is in the host's (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)), int(port, 16)


def listening(pid: int) -> set[tuple[str, int]]:
    """The ``(address, port)`` of every TCP socket `pid` listens on."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    found.add(_decode(fields[1]))
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _wait_ready(folder, count, proc, timeout=300) -> list[dict]:
    deadline = time.monotonic() + timeout
    paths = [folder / f"ready{r}.json" for r in range(count)]
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            raise AssertionError(
                f"the job ended early with code {proc.returncode}: "
                + proc.stdout.read()[-3000:]
            )
        assert time.monotonic() < deadline, "the workers never got ready"
        time.sleep(0.5)
    return [json.loads(p.read_text()) for p in paths]


def _check_listening(records) -> dict:
    """Asserts that every worker listens on loopback only (TensorFlow's
    gRPC servers excepted: TensorFlow binds them to every interface and
    offers no setting, as guides/multi_worker.md says). Returns what
    listens where, by rank."""
    where = {}
    for record in records:
        sockets = listening(record["pid"])
        where[record["rank"]] = sorted(sockets)
        server_port = None
        if record["server"]:
            server_port = int(record["server"].rsplit(":", 1)[1])
        for address, port in sockets:
            if port == server_port:
                assert BACKEND == "tensorflow"
                continue  # TF's gRPC server: documented, unbindable
            assert _loopback(address), (
                f"rank {record['rank']} listens on {address}:{port}, not "
                f"on loopback; all: {sorted(sockets)}"
            )
        if BACKEND == "tensorflow":
            # The documented exception is real: the server is there, on
            # every interface (if TF ever binds it to loopback, say so).
            assert any(p == server_port for _, p in sockets), sockets
    print(f"{BACKEND} listening by rank: {where}")
    return where


def _kill_and_check(victim: int, workers: list[int]) -> float:
    """SIGKILLs `victim` and asserts that no process of `workers` is left
    within 10 s; returns the seconds it took."""
    start = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() - start < 10, (
            "workers left after their launcher was killed: "
            f"{[pid for pid in workers if _alive(pid)]}"
        )
        time.sleep(0.1)
    return time.monotonic() - start


def _run(command, env, folder, stderr=subprocess.STDOUT):
    return subprocess.Popen(
        command,
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,  # so that cleanup can kill the whole job
    )


def _cleanup(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(30)
    proc.stdout.close()


@pytest.mark.multi_process
@pytest.mark.slow
def test_launched_job_listens_on_loopback_and_dies_with_its_launcher(
    tmp_path,
):
    script = tmp_path / "train.py"
    script.write_text(
        TRAIN_THEN_WAIT.format(
            strategy="MultiWorkerMirroredStrategy", folder=str(tmp_path)
        )
    )
    command = [sys.executable, "-m", "keras_dist.launch"]
    command += ["--nproc-per-node", "2", str(script)]
    proc = _run(command, _clean_env(), tmp_path)
    try:
        records = _wait_ready(tmp_path, 2, proc)
        assert not listening(proc.pid)  # the launcher itself listens nowhere
        _check_listening(records)
        seconds = _kill_and_check(proc.pid, [r["pid"] for r in records])
        print(f"{BACKEND}: workers gone {seconds:.2f} s after SIGKILL")
    finally:
        _cleanup(proc)


@pytest.mark.multi_process
@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "torch", reason="torch's self-relaunch")
def test_relaunched_torch_job_under_python_c(tmp_path):
    # `python -c` re-runs as it was started; rank 1 dies with rank 0.
    code = TRAIN_THEN_WAIT.format(
        strategy="MirroredStrategy", folder=str(tmp_path)
    )
    env = dict(_clean_env(), KERAS_DIST_CPU_DEVICES="2")
    proc = _run([sys.executable, "-c", code], env, tmp_path)
    try:
        records = _wait_ready(tmp_path, 2, proc)
        assert records[0]["pid"] == proc.pid
        _check_listening(records)
        seconds = _kill_and_check(proc.pid, [records[1]["pid"]])
        print(f"torch relaunch: rank 1 gone {seconds:.2f} s after SIGKILL")
    finally:
        _cleanup(proc)


@pytest.mark.multi_process
@pytest.mark.skipif(BACKEND != "torch", reason="torch's one-worker job")
def test_one_torch_worker_under_python_c():
    # It once refused, "would start one process per device". Run with
    # KERAS_DIST_BIND_ALL=1: its store then listens on every interface.
    code = textwrap.dedent(
        f"""
        import os, sys
        import keras_dist
        strategy = keras_dist.MultiWorkerMirroredStrategy()
        print("replicas", strategy.num_replicas_in_sync)
        sys.path.insert(0, {ROOT!r})
        from tests.test_supervision import listening
        print("listening", sorted(listening(os.getpid())))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(_clean_env(), KERAS_DIST_BIND_ALL="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replicas 1" in proc.stdout
    sockets = proc.stdout.split("listening", 1)[1]
    assert "('::', " in sockets or "('0.0.0.0', " in sockets, sockets


# The middle process starts a child through `launcher.spawn` as it does
# where Linux's parent-death signal is missing (a pipe the child watches),
# prints the child's pid and waits to be killed.
PIPE_PARENT = """
import subprocess, sys, time
from keras_dist._src.cluster import launcher
launcher._prctl = lambda: None  # as on macOS: no PR_SET_PDEATHSIG
child = launcher.spawn(
    [sys.executable, "-c", "from keras_dist._src.cluster import supervision;"
     "supervision.watch_launcher(); print('watching', flush=True);"
     "import time; time.sleep(600)"],
    dict(__import__("os").environ),
    stdout=subprocess.PIPE, text=True,
)
assert child.stdout.readline().strip() == "watching"
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.multi_process
@pytest.mark.slow
def test_pipe_watch_ends_a_worker_whose_launcher_died(tmp_path):
    # Its stdout holds the pid line alone: a backend's start-up lines
    # (TensorFlow's C++ INFO lines at import, on some CPUs) go to a file.
    # Read into stdout, they came first, and reading the rest for the
    # assertion's message waited for the middle process's 600 s sleep.
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        proc = _run(
            [sys.executable, "-c", PIPE_PARENT], _clean_env(), tmp_path, stderr
        )
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), line + stderr_path.read_text()[-3000:]
        child = int(line)
        assert _alive(child)
        _kill_and_check(proc.pid, [child])
    finally:
        _cleanup(proc)


# Ignores SIGTERM, so that only SIGKILL stops it.
STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.multi_process
@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="backend-neutral: run in one lane only"
)
def test_stop_processes_terminates_then_kills_after_the_grace():
    # The one stop of every launcher (keras-dist launch with and without
    # --ps, rank 0's Supervisor, local_cluster) and its exit codes.
    from keras_dist._src.cluster import supervision

    polite = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"]
    )
    stubborn = subprocess.Popen(
        [sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True
    )
    try:
        assert stubborn.stdout.readline() == "ready\n"
        started = time.monotonic()
        supervision.stop_processes([polite, stubborn], grace=1.0)
        waited = time.monotonic() - started
        assert polite.returncode == -signal.SIGTERM
        assert stubborn.returncode == -signal.SIGKILL
        assert 1.0 <= waited < 10.0, waited
        # grace=0: SIGKILL at once.
        again = subprocess.Popen([sys.executable, "-c", STUBBORN])
        supervision.stop_processes([again], grace=0)
        assert again.returncode == -signal.SIGKILL
    finally:
        for proc in (polite, stubborn):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stubborn.stdout.close()
    assert supervision.exit_status(stubborn.returncode) == 128 + 9
    assert supervision.exit_status(3) == 3
    assert supervision.exit_status(0) == 0
