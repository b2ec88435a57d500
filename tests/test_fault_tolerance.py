"""Jobs that heal themselves: ``keras-dist launch`` restarts and hangs.

Real jobs of 2 workers on localhost (``keras-dist launch`` picks free
ports): a worker SIGKILLed mid-`fit` under ``--max-restarts 1`` ends with
the weights of an uninterrupted run; a worker that raises at the same step
every time stops the restarts after its second failure; a worker that
sleeps inside a step ends the job within the hang timeout, with both
workers' stacks and the sleeping rank named; two launchers standing for
two nodes under ``--nnodes 1:2``, one of them SIGKILLed, finish on the
node left with the weights of plain Keras on one device. The restart
logic is the launcher's, the same on every backend; the jobs run on this
lane's backend where it is JAX or torch (TensorFlow's lane is the
longest), the two-node job on torch's only.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest

from keras_dist._src.cluster import progress, restarts

BACKEND = keras.backend.backend()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import os, signal, sys, time
import numpy as np
import keras
import keras_dist
from keras_dist.callbacks import BackupAndRestore

mode, folder, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank = int(os.environ["RANK"])
restart = int(os.environ["KERAS_DIST_RESTART_COUNT"])
print(f"attempt {restart} started at {time.time():.3f}", flush=True)
strategy = keras_dist.MultiWorkerMirroredStrategy()

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = rng.normal(size=(64, 2)).astype("float32")


def build():
    keras.backend.clear_session()
    keras.utils.set_random_seed(7)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dropout(0.25),
            keras.layers.Dense(2),
        ])
        model.compile(optimizer="adam", loss="mse")
    return model


def dump(model, path):
    arrays = [keras.ops.convert_to_numpy(v)
              for v in model.variables + model.optimizer.variables]
    if strategy.is_chief:
        np.savez(path, *arrays)


def sleep_in_step_on_rank_1():
    time.sleep(600)


class Fault(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step = self.epoch * 8 + batch + 1
        print(f"step {step} at {time.time():.3f}", flush=True)
        if rank != 1 or step != at:
            return
        if mode == "kill" and restart == 0:
            print(f"fault at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "raise":
            raise RuntimeError(f"a bug at step {step}")
        if mode == "hang":
            print(f"fault at {time.time():.3f}", flush=True)
            sleep_in_step_on_rank_1()


if mode == "kill" and restart == 0:  # the uninterrupted reference first
    reference = build()
    reference.fit(x, y, batch_size=8, epochs=3, shuffle=True, verbose=0)
    dump(reference, os.path.join(folder, "ref.npz"))
model = build()
backup = BackupAndRestore(os.path.join(folder, "backup"), save_freq=2)
model.fit(x, y, batch_size=8, epochs=3, shuffle=True, verbose=0,
          callbacks=[backup, Fault()])
dump(model, os.path.join(folder, "w.npz"))
print("restored_from", backup.restored_from, flush=True)
"""

needs_job_backend = pytest.mark.skipif(
    BACKEND == "tensorflow",
    reason="launcher logic, backend-neutral: run on the JAX and torch lanes",
)


def launch(tmp_path, mode, at, *options, timeout=300):
    """Runs the script under ``keras-dist launch`` with 2 workers;
    returns (exit code, output, seconds)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, KERAS_BACKEND=BACKEND, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.pop("KERAS_DIST_CPU_DEVICES", None)
    command = [sys.executable, "-m", "keras_dist.launch"]
    command += ["--nproc-per-node", "2", "--restart-backoff", "0.5"]
    command += [*options, str(script), mode, str(tmp_path), str(at)]
    started = time.monotonic()
    proc = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )
    took = time.time() - started
    return proc.returncode, proc.stdout + proc.stderr, took


def _times(log, pattern):
    return [float(t) for t in re.findall(pattern, log)]


@pytest.mark.slow
@pytest.mark.multi_process
@needs_job_backend
def test_killed_worker_restarts_and_matches_uninterrupted_run(tmp_path):
    at = 11
    code, log, took = launch(tmp_path, "kill", at, "--max-restarts", "1")
    assert code == 0, log[-4000:]
    assert "worker rank 1 was killed by SIGKILL" in log
    assert f"at step {at - 1}; restart 1 of 1 in 0.5 s" in log, log[-4000:]
    assert "[rank 0] attempt 1 started" in log
    assert "[rank 1] attempt 1 started" in log
    assert "the job succeeded after 1 restart(s)" in log
    # Resumed from the last save before the fault (every 2 steps).
    assert re.search(r"\[rank 0\] restored_from .*ckpt-10\b", log), log
    with np.load(tmp_path / "ref.npz") as a, np.load(tmp_path / "w.npz") as b:
        assert a.files == b.files
        for key in a.files:
            np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-6)
    fault = _times(log, r"fault at ([\d.]+)")[0]
    second = log[log.index("[rank 0] attempt 1 started") :]
    back = re.search(r"\[rank 0\] step (\d+) at ([\d.]+)", second)
    begun = _times(second, r"attempt 1 started at ([\d.]+)")[0]
    print(
        f"\nFT-FIGURE {BACKEND} kill at step {at}: first step again is "
        f"step {back.group(1)}, {float(back.group(2)) - fault:.1f} s after "
        f"the fault (the script ran again after {begun - fault:.1f} s); "
        f"whole job {took:.1f} s"
    )


@pytest.mark.slow
@pytest.mark.multi_process
@pytest.mark.skipif(
    BACKEND != "jax",
    reason="the launcher's rule, whatever the workers run: one lane (the "
    "rule's cases run without a backend below)",
)
def test_failure_at_the_same_step_twice_stops_restarts(tmp_path):
    code, log, took = launch(tmp_path, "raise", 5, "--max-restarts", "3")
    assert code == 1, log[-4000:]
    assert "RuntimeError: a bug at step 5" in log
    assert "restart 1 of 3" in log
    assert "restart 2 of 3" not in log
    # Rank 1 fails; under load torch's rank 0, stopped by rank 1's
    # reported failure, may exit first: either is named, the step is the
    # last one both finished.
    assert re.search(
        r"rank [01]\)? failed twice at step 4 \(exit 1\): that looks like "
        r"a bug in the script, not a fault; not restarting",
        log,
    ), log[-4000:]
    assert "[rank 1] attempt 2 started" not in log
    print(f"\nFT-FIGURE {BACKEND} repeated bug: job {took:.1f} s")


@pytest.mark.slow
@pytest.mark.multi_process
@needs_job_backend
def test_hung_rank_ends_the_job_with_stacks_and_its_name(tmp_path):
    code, log, took = launch(tmp_path, "hang", 4, "--hang-timeout", "3")
    assert code == restarts.HANG_EXIT_CODE, log[-4000:]
    fault = _times(log, r"fault at ([\d.]+)")[0]
    # Ended within the timeout, the stack wait and slack for 2 cores.
    ended = time.time()
    assert ended - fault < 3 + restarts.STACK_WAIT_S + 15, log[-4000:]
    assert "no progress for" in log, log[-4000:]
    assert "rank 1 is behind, at step 3. Where each rank was" in log
    assert "rank 1 at step 3" in log and "rank 0 at step 4" in log
    # Both ranks' stacks, the sleeping callback in rank 1's.
    assert re.search(r"\[rank 1\] .*in sleep_in_step_on_rank_1", log), log
    assert re.search(r"\[rank 0\] (Current thread|Thread) 0x", log)
    assert re.search(r"\[rank 1\] (Current thread|Thread) 0x", log)
    assert "attempt 1 started" not in log  # no --max-restarts: no restart
    print(
        f"\nFT-FIGURE {BACKEND} hang: fault to job end "
        f"{ended - fault:.1f} s (timeout 3 s), job {took:.1f} s"
    )


ELASTIC = """
import os, sys, time
import numpy as np
import keras
import keras_dist
from keras_dist.callbacks import BackupAndRestore

folder = sys.argv[1]
restart = int(os.environ["KERAS_DIST_RESTART_COUNT"])
strategy = keras_dist.MultiWorkerMirroredStrategy()
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = rng.normal(size=(64, 2)).astype("float32")
keras.utils.set_random_seed(7)
with strategy.scope():
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(2),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")


class Slow(keras.callbacks.Callback):  # time for the test to kill a node
    def on_train_batch_end(self, batch, logs=None):
        print(f"step {batch + 1} replicas {strategy.num_replicas_in_sync} "
              f"at {time.time():.3f}", flush=True)
        if restart == 0:
            time.sleep(0.4)


backup = BackupAndRestore(os.path.join(folder, "backup"), save_freq=2)
model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
          callbacks=[backup, Slow()])
if strategy.is_chief:
    np.savez(os.path.join(folder, "w.npz"), *model.get_weights())
print("restored_from", backup.restored_from, flush=True)
"""


@pytest.mark.slow
@pytest.mark.multi_process
@pytest.mark.skipif(
    BACKEND != "torch",
    reason="the launchers' rendezvous, whatever the workers run: one lane",
)
def test_lost_node_job_goes_on_with_the_nodes_left(tmp_path):
    """``--nnodes 1:2``: two launchers on this host stand for two nodes;
    node 1's launcher is SIGKILLed mid-`fit` and does not come back. Node
    0's launcher notices, waits the rendezvous timeout, restarts on
    itself alone from the checkpoint, and ends with the weights of plain
    Keras on one device (the same global batch)."""
    from keras_dist._src.cluster.launcher import free_port

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(ELASTIC))
    env = dict(os.environ, KERAS_BACKEND=BACKEND, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("KERAS_DIST_CPU_DEVICES", None)
    port = str(free_port())

    def node(rank):
        command = [sys.executable, "-m", "keras_dist.launch"]
        command += ["--nnodes", "1:2", "--node-rank", str(rank)]
        command += ["--master-addr", "127.0.0.1", "--master-port", port]
        command += ["--max-restarts", "1", "--rdzv-timeout", "8"]
        command += ["--restart-backoff", "0.5", str(script), str(tmp_path)]
        return subprocess.Popen(
            command,
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    started = time.time()
    nodes = [node(0), node(1)]
    try:
        seen = []
        for line in nodes[1].stdout:  # node 1 kills at its fifth step
            seen.append(line)
            if "[rank 1] step 5 " in line:
                nodes[1].kill()
                killed = time.time()
                break
        else:
            pytest.fail("node 1 ended before step 5:\n" + "".join(seen))
        log, _ = nodes[0].communicate(timeout=300)
    finally:
        for proc in nodes:
            proc.kill()
            proc.wait()
    took = time.time() - started
    assert nodes[0].returncode == 0, log[-4000:]
    assert "round 0: node 0 of 2" in log, log[-4000:]
    assert "round 1: node 0 of 1" in log, log[-4000:]
    assert "the job succeeded after 1 restart(s)" in log, log[-4000:]
    assert "replicas 1" in log and "replicas 2" in log
    # Resumed from a checkpoint of the two-node round, not from scratch.
    assert re.search(r"\[rank 0\] restored_from .*ckpt-\d+", log), log

    keras.utils.set_random_seed(7)
    reference = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(2),
        ]
    )
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 2)).astype("float32")
    reference.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    with np.load(tmp_path / "w.npz") as got:
        weights = [got[f"arr_{i}"] for i in range(len(got.files))]
    for a, b in zip(reference.get_weights(), weights):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    print("".join(f"  {x}\n" for x in log.splitlines() if "keras_dist:" in x))
    again = _times(log, r"\[rank 0\] step \d+ replicas 1 at ([\d.]+)")[0]
    print(
        f"\nFT-FIGURE {BACKEND} lost node: fault to the first step on the "
        f"node left {again - killed:.1f} s; job {took:.1f} s"
    )


# -- the launcher's rules, without a backend ---------------------------------
def test_policy_and_timeouts_refuse_what_cannot_hold(monkeypatch):
    from keras_dist._src.cluster import node_launcher

    with pytest.raises(ValueError, match="--max-restarts -1"):
        restarts.RestartPolicy(max_restarts=-1).check()
    with pytest.raises(ValueError, match="--hang-timeout"):
        restarts.RestartPolicy(hang_timeout=0).check()
    monkeypatch.setenv(progress.ENV_HANG_TIMEOUT, "soon")
    with pytest.raises(ValueError, match="KERAS_DIST_HANG_TIMEOUT='soon'"):
        node_launcher.LaunchConfig(["t.py"]).check()
    monkeypatch.setenv(progress.ENV_HANG_TIMEOUT, "20")
    policy = node_launcher.LaunchConfig(["t.py"]).policy()
    assert policy.hang_timeout == 20 and policy.startup == 300
    assert restarts.RestartPolicy(hang_timeout=60).startup == 600
    config = node_launcher.LaunchConfig(
        ["t.py"], nnodes=2, master_port=1, max_restarts=1
    )
    config.check()  # several nodes restart together (`elastic`)
    assert config.rendezvous
    elastic = node_launcher.LaunchConfig(
        ["t.py"], nnodes=2, min_nodes=1, master_port=1
    )
    assert elastic.rendezvous
    with pytest.raises(ValueError, match="MIN:MAX"):
        node_launcher.LaunchConfig(
            ["t.py"], nnodes=2, min_nodes=3, master_port=1
        ).check()
    with pytest.raises(ValueError, match="--master-port"):
        node_launcher.LaunchConfig(["t.py"], nnodes=2, min_nodes=1).check()
    monkeypatch.delenv(progress.ENV_HANG_TIMEOUT)
    ps_job = node_launcher.LaunchConfig(["t.py"], ps=1, workers=1)
    dataclasses.replace(ps_job, max_restarts=1).check()  # replaces tasks


def test_board_tells_hang_from_slow_start(tmp_path):
    now = [100.0]
    board = progress.ProgressBoard(str(tmp_path), [0, 1], lambda: now[0])
    writers = [progress.ProgressWriter(str(tmp_path), r) for r in (0, 1)]
    for writer in writers:
        writer.report("start", 0, -1, -1)
    board.poll()
    now[0] += 50  # compiling: only the start-up timeout applies
    assert board.stalled(5, 60) == []
    writers[0].report("train", 0, 0, 1)
    board.poll()
    now[0] += 11  # rank 1 still before its first step: 61 s
    assert board.stalled(5, 60) == [0, 1]
    assert board.position(0) == progress.Position("train", 0, 0, 1)
    assert board.position(1).describe() == "before its first step"
    writers[0].report("done")
    writers[1].report("train", 0, 0, 1)
    board.poll()
    now[0] += 100
    assert board.stalled(5, 60) == [1]  # out of fit: not watched
    for writer in writers:
        writer.close()


def test_repeat_rule_counts_only_the_scripts_own_failures():
    at = progress.Position("train", 1, 3, 12)
    kill = restarts.Outcome(137, "failed", 1, -9, at)
    bug = restarts.Outcome(1, "failed", 0, 1, at)
    hang = restarts.Outcome(124, "hung", 1, None, at)
    assert not restarts._repeated(kill, kill)  # killed from outside
    assert restarts._repeated(bug, bug)
    assert restarts._repeated(bug, hang)
    later = restarts.Outcome(
        1, "failed", 0, 1, progress.Position("train", 1, 4, 13)
    )
    assert not restarts._repeated(bug, later)
    assert bug.describe() == "worker rank 0 exited with code 1 at step 12"


# Workers without a backend (about 0.1 s to start): the restart rules for
# a preemption and for a stop asked of the launcher itself.
_PLAIN_WORKER = """
import os, sys, time
rank, mode = int(os.environ["RANK"]), sys.argv[1]
restart = int(os.environ["KERAS_DIST_RESTART_COUNT"])
print(f"attempt {restart} progress {os.environ.get('KERAS_DIST_PROGRESS_DIR')}",
      flush=True)
if mode == "preempted-once" and restart == 0 and rank == 1:
    sys.exit(75)
if mode == "hang":  # steps 1..3 on rank 0, 1..2 on rank 1, then stuck
    import importlib.util  # the module alone: keras_dist imports Keras
    spec = importlib.util.spec_from_file_location("progress", sys.argv[2])
    progress = sys.modules["progress"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(progress)
    progress.register_stack_dump()
    writer = progress.ProgressWriter(os.environ["KERAS_DIST_PROGRESS_DIR"],
                                     rank)
    for step in range(1, 4 - rank):
        writer.report("train", 0, step - 1, step)

    def stuck_in_a_collective():
        time.sleep(60)

    stuck_in_a_collective()
if mode == "wait":
    open(os.path.join(sys.argv[2], f"ready{restart}-{rank}"), "w").close()
    time.sleep(60)
time.sleep(0.5)
"""


@pytest.mark.multi_process
@pytest.mark.skipif(
    BACKEND != "jax", reason="backend-neutral: run in one lane only"
)
def test_preemption_restarts_but_a_stop_asked_of_the_launcher_does_not(
    tmp_path,
):
    script = tmp_path / "worker.py"
    script.write_text(_PLAIN_WORKER)
    command = [sys.executable, "-m", "keras_dist.launch"]
    command += ["--nproc-per-node", "2", "--max-restarts", "2"]
    command += ["--restart-backoff", "0", str(script)]
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(
        [*command, "preempted-once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "workers stopped for preemption (exit 75); restart 1 of 2" in log
    assert "[rank 0] attempt 1 progress " in log
    assert "attempt 0 progress None" not in log  # reports were asked for
    assert "attempt 2" not in log

    # SIGTERM to the launcher: forwarded, and no restart.
    proc = subprocess.Popen(
        [*command, "wait", str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("ready0-*"))) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + 15, out
    assert "not restarting: the launcher got SIGTERM" in out
    assert "attempt 1" not in out


@pytest.mark.multi_process
@pytest.mark.skipif(
    BACKEND != "jax", reason="backend-neutral: run in one lane only"
)
def test_a_hang_restarts_and_a_second_hang_at_that_step_stops(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_PLAIN_WORKER)
    command = [sys.executable, "-m", "keras_dist.launch"]
    command += ["--nproc-per-node", "2", "--max-restarts", "3"]
    command += ["--restart-backoff", "0", "--hang-timeout", "1"]
    proc = subprocess.run(
        [*command, str(script), "hang", progress.__file__],
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=60,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == restarts.HANG_EXIT_CODE, log
    assert "rank 1 is behind, at step 2" in log
    assert "rank 0 is behind" not in log
    assert "worker rank 1 hung at step 2; restart 1 of 3" in log
    assert (
        "worker rank 1 hung twice at step 2 (hang timeout, exit 124): "
        "that looks like a bug" in log
    ), log
    for rank in (0, 1):
        assert f"[rank {rank}]   File" in log  # each rank's stack, twice
        assert log.count(f"[rank {rank}] Current thread") == 2, log
    assert "in stuck_in_a_collective" in log
    assert "attempt 2" not in log


def test_fit_reports_its_progress_to_the_launchers_directory(
    tmp_path, monkeypatch
):
    # In this process: what a worker of `keras-dist launch` writes.
    import keras_dist

    monkeypatch.setenv(progress.ENV_PROGRESS_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    seen = []

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((tmp_path / "rank-3").read_text().split()[:4])

    strategy = keras_dist.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    x = np.zeros((32, 4), "float32")
    model.fit(
        x, x[:, :2], batch_size=8, epochs=2, verbose=0, callbacks=[Look()]
    )
    # Each batch end of the user's callback sees the step before (the
    # report comes after it); the end of fit says "done".
    assert seen[0] == ["start", "0", "-1", "-1"]
    assert seen[1] == ["train", "0", "0", "1"]
    assert seen[4] == ["train", "0", "3", "4"]  # epoch 2's first batch
    final = progress.Position.parse((tmp_path / "rank-3").read_text())
    assert final == progress.Position("done", 1, 3, 8)
