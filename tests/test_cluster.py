"""Cluster discovery: one test per launcher source, plus bad settings."""

import json
import os
import subprocess
import sys
import time

import keras
import pytest

from keras_dist._src.cluster import allocator
from keras_dist._src.cluster import environments as envs
from keras_dist._src.cluster.environments import (
    ClusterConfigError,
    detect_environment,
)


def test_no_launcher_is_one_local_process():
    env = detect_environment({})
    assert (env.source, env.rank, env.world_size) == ("local", 0, 1)
    assert env.is_chief and not env.is_distributed
    assert env.coordinator_address is None


def test_torchelastic():
    env = detect_environment(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "29400",
        }
    )
    assert env.source == "torchelastic"
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    assert env.local_world_size == 2 and not env.is_chief
    assert env.coordinator_address == "node0:29400"
    assert env.torchrun_variables()["MASTER_PORT"] == "29400"


def test_torchelastic_incomplete_names_what_is_missing():
    with pytest.raises(ClusterConfigError, match="MASTER_PORT"):
        detect_environment({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    with pytest.raises(ClusterConfigError, match="rank 5 is outside"):
        detect_environment(
            {
                "RANK": "5",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
            }
        )
    with pytest.raises(ClusterConfigError, match="not an integer"):
        detect_environment(
            {
                "RANK": "x",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
            }
        )


def _tf_config(kind, index, workers=2, chief=False):
    cluster = {"worker": [f"10.0.0.{i}:2222" for i in range(workers)]}
    if chief:
        cluster["chief"] = ["10.0.0.9:2222"]
    return {
        "TF_CONFIG": json.dumps(
            {"cluster": cluster, "task": {"type": kind, "index": index}}
        )
    }


def test_tf_config():
    env = detect_environment(_tf_config("worker", 1))
    assert env.source == "tf_config"
    assert (env.rank, env.world_size) == (1, 2)
    assert env.coordinator_address == "10.0.0.0:2222"
    assert env.worker_addresses == ("10.0.0.0:2222", "10.0.0.1:2222")
    # A chief comes first: worker 0 is then process 1.
    env = detect_environment(_tf_config("worker", 0, chief=True))
    assert (env.rank, env.world_size) == (1, 3)
    assert detect_environment(_tf_config("chief", 0, chief=True)).is_chief


def test_tf_config_errors():
    with pytest.raises(ClusterConfigError, match="not valid JSON"):
        detect_environment({"TF_CONFIG": "{oops"})
    with pytest.raises(ClusterConfigError, match="task index 5"):
        detect_environment(_tf_config("worker", 5))
    with pytest.raises(ClusterConfigError, match="'ps'"):
        detect_environment(_tf_config("ps", 0))
    bad = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}})}
    with pytest.raises(ClusterConfigError, match="'task'"):
        detect_environment(bad)


def test_tf_config_and_torchrun_must_agree():
    environ = _tf_config("worker", 1)
    environ.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1")
    with pytest.raises(ClusterConfigError, match="conflict"):
        detect_environment(environ)
    environ["RANK"] = "1"
    assert detect_environment(environ).source == "tf_config"


SLURM = {
    "SLURM_JOB_ID": "12345",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS_PER_NODE": "4(x2)",
}


def test_slurm_srun_step():
    # An sbatch script (no srun step) is not a rank.
    assert detect_environment(SLURM).source == "local"
    environ = dict(SLURM, SLURM_STEP_NODELIST="gpu[003-005,9],cpu1")
    env = detect_environment(environ)
    assert env.source == "slurm"
    assert (env.rank, env.world_size, env.local_rank) == (5, 8, 1)
    assert env.local_world_size == 4
    assert env.coordinator_address == f"gpu003:{12345 % 4096 + 61440}"
    environ["MASTER_PORT"] = "29400"
    assert detect_environment(environ).coordinator_port == 29400
    # One task: nothing to join.
    assert detect_environment(dict(environ, SLURM_NTASKS="1")).source == (
        "local"
    )
    with pytest.raises(ClusterConfigError, match="SLURM_PROCID"):
        detect_environment(
            {k: v for k, v in environ.items() if k != "SLURM_PROCID"}
        )


def test_torchrun_inside_slurm_wins():
    environ = dict(SLURM, SLURM_STEP_NODELIST="n[1-2]", SLURM_NTASKS="2")
    environ.update(
        RANK="6", WORLD_SIZE="8", MASTER_ADDR="n1", MASTER_PORT="29500"
    )
    env = detect_environment(environ)
    assert (env.source, env.rank, env.world_size) == ("torchelastic", 6, 8)


def test_open_mpi():
    environ = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    with pytest.raises(ClusterConfigError, match="MASTER_ADDR"):
        detect_environment(environ)
    environ.update(MASTER_ADDR="host0", MASTER_PORT="29400")
    env = detect_environment(environ)
    assert env.source == "mpi"
    assert (env.rank, env.world_size, env.local_world_size) == (2, 4, 2)
    with pytest.raises(ClusterConfigError, match="OMPI_COMM_WORLD_LOCAL"):
        detect_environment(
            {
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "1",
            }
        )


def test_first_slurm_host():
    assert envs.first_slurm_host("gpu[003-005,9],cpu1") == "gpu003"
    assert envs.first_slurm_host("node7") == "node7"
    assert envs.first_slurm_host("a[1,2]") == "a1"


def test_untested_keras_version_warns_once_clearly():
    from keras_dist._src.keras_glue import check_keras_version

    assert check_keras_version("3.15.1")
    assert check_keras_version("3.16.0.dev2026102704")
    with pytest.warns(UserWarning, match=r"tested with Keras 3\.15\.x, 3\.16"):
        assert not check_keras_version("3.9.2")


def test_launch_gives_each_worker_torchrun_variables():
    from keras_dist._src.cluster import node_launcher
    from keras_dist._src.cluster.environments import detect_environment

    config = node_launcher.LaunchConfig(
        command=["train.py"],
        nproc_per_node=2,
        nnodes=2,
        node_rank=1,
        master_addr="node0",
        master_port=29400,
        cpu_devices_per_process=3,
    )
    envs = node_launcher.worker_environments(
        config, base={"KERAS_BACKEND": "jax"}
    )
    places = [detect_environment(env) for env in envs]
    assert [(p.rank, p.local_rank) for p in places] == [(2, 0), (3, 1)]
    assert {p.world_size for p in places} == {4}
    assert {p.coordinator_address for p in places} == {"node0:29400"}
    assert all(env["KERAS_DIST_CPU_DEVICES"] == "3" for env in envs)
    assert all("TF_CONFIG" not in env for env in envs)


def test_launch_on_tensorflow_adds_a_consistent_tf_config():
    from keras_dist._src.cluster import node_launcher
    from keras_dist._src.cluster.environments import detect_environment

    config = node_launcher.LaunchConfig(command=["t.py"], nproc_per_node=2)
    envs = node_launcher.worker_environments(
        config, base={"KERAS_BACKEND": "tensorflow"}
    )
    for rank, env in enumerate(envs):
        # TF_CONFIG and torchrun's variables agree (no conflict error).
        place = detect_environment(env)
        assert (place.source, place.rank, place.world_size) == (
            "tf_config",
            rank,
            2,
        )
    assert len(set(place.worker_addresses)) == 2


def test_launch_arguments_and_bad_options():
    import argparse

    from keras_dist._src.cluster import node_launcher

    parser = argparse.ArgumentParser()
    node_launcher.add_arguments(parser)
    args = parser.parse_args(
        ["--nproc-per-node", "2", "train.py", "--epochs", "3"]
    )
    config = node_launcher.config_from_args(args)
    assert config.command == ["train.py", "--epochs", "3"]
    assert config.nproc_per_node == 2
    with pytest.raises(ValueError, match="--master-port"):
        node_launcher.LaunchConfig(["t.py"], nnodes=2).check()
    with pytest.raises(ValueError, match="--node-rank 3"):
        node_launcher.LaunchConfig(
            ["t.py"], nnodes=2, node_rank=3, master_port=1
        ).check()


# A worker of `keras-dist launch` without any backend (about 0.1 s to
# start): what each rank does for each mode of the launcher test below.
_PLAIN_WORKER = """
import os, signal, sys, time
rank, mode = int(os.environ["RANK"]), sys.argv[1]
print(f"pid {os.getpid()}", flush=True)
if mode == "ok":
    sys.exit(0)
if mode == "preempted":
    sys.exit(75)
if mode == "signal":
    def stop(signum, frame):
        print(f"got signal {signum}", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGUSR1, stop)
    here = os.path.dirname(os.path.abspath(__file__))
    open(os.path.join(here, f"ready{rank}"), "w").close()
elif rank == 1:  # fails while rank 0 still runs
    if mode == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
time.sleep(60)
"""


@pytest.mark.multi_process
@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="backend-neutral: run in one lane only",
)
def test_launch_rules_with_plain_worker_processes(tmp_path, capfd):
    # keras-dist launch --nproc-per-node 2: exit codes, prefixed output,
    # forwarded signals, and a failed rank stopping the other one.
    import signal
    import threading

    from keras_dist._src.cluster import node_launcher

    script = tmp_path / "worker.py"
    script.write_text(_PLAIN_WORKER)

    def launch(mode):
        config = node_launcher.LaunchConfig([str(script), mode], 2)
        code = node_launcher.launch(config)
        out, err = capfd.readouterr()
        pids = [
            int(line.split()[-1]) for line in out.splitlines() if "pid" in line
        ]
        return code, out, err, pids

    code, out, err, _ = launch("ok")
    assert code == 0, err
    assert "[rank 0] pid " in out and "[rank 1] pid " in out
    assert launch("preempted")[0] == 75  # requeue, not a failure
    started = time.monotonic()
    code, out, err, pids = launch("fails")
    assert code == 3
    assert "worker rank 1 exited with code 3; stopping the other" in err
    assert time.monotonic() - started < 30  # rank 0 (60 s) was stopped
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)
    code, out, err, _ = launch("killed")
    assert code == 128 + 9
    assert "worker rank 1 was killed by SIGKILL" in err

    def signal_when_ready():  # SIGUSR1 to the launcher, once both wait
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if len(list(tmp_path.glob("ready*"))) == 2:
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.getsignal(signal.SIGUSR1)
    sender = threading.Thread(target=signal_when_ready)
    sender.start()
    code, out, err, _ = launch("signal")
    sender.join()
    assert code == 0, err
    for rank in (0, 1):
        assert f"[rank {rank}] got signal {int(signal.SIGUSR1)}" in out
    assert signal.getsignal(signal.SIGUSR1) is previous  # restored


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _place(host, world=2, local_world=2, workers=()):
    return envs.ClusterEnvironment(
        source="explicit",
        world_size=world,
        local_world_size=local_world,
        coordinator_host=host,
        coordinator_port=29400,
        worker_addresses=tuple(workers),
    )


def test_bind_loopback_for_one_host_jobs(monkeypatch):
    from keras_dist._src.cluster import binding

    monkeypatch.delenv(binding.ENV_BIND_ALL, raising=False)
    assert binding.bind_host(_place("127.0.0.1")) == "127.0.0.1"
    assert binding.bind_host(_place("localhost")) == "127.0.0.1"
    assert binding.bind_host(_place("127.0.0.2")) == "127.0.0.2"
    assert binding.bind_host(_place("::1")) == "::1"
    tf_workers = ["127.0.0.1:2222", "127.0.0.1:2223"]
    assert binding.bind_host(_place("127.0.0.1", workers=tf_workers)) == (
        "127.0.0.1"
    )
    # Several hosts: the given address, never loopback.
    assert binding.bind_host(_place("10.1.2.3", 4)) == "10.1.2.3"
    mixed = ["10.1.2.3:2222", "127.0.0.1:2223"]
    assert binding.bind_host(_place("127.0.0.1", workers=mixed)) == (
        "127.0.0.1"
    )
    # A name that resolves to loopback here in a job over two hosts
    # (Debian's 127.0.1.1 for the host name): every interface.
    assert binding.bind_host(_place("127.0.1.1", 4, 2)) is None
    assert binding.format_address(None, 5) == "[::]:5"
    assert binding.format_address("::1", 5) == "[::1]:5"
    assert binding.format_address("127.0.0.1", 5) == "127.0.0.1:5"


def test_bind_all_interfaces_on_request(monkeypatch):
    from keras_dist._src.cluster import binding

    monkeypatch.setenv(binding.ENV_BIND_ALL, "1")
    assert binding.bind_host(_place("127.0.0.1")) is None
    monkeypatch.setenv(binding.ENV_BIND_ALL, "maybe")
    with pytest.raises(ValueError, match="KERAS_DIST_BIND_ALL='maybe'"):
        binding.bind_host(_place("127.0.0.1"))


def test_listen_socket_on_a_foreign_address_says_what_to_do():
    from keras_dist._src.cluster import binding
    from keras_dist._src.errors import KerasDistError

    sock = binding.listen_socket("127.0.0.1", 0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()
    with pytest.raises(KerasDistError, match="KERAS_DIST_BIND_ALL=1"):
        binding.listen_socket("192.0.2.250", 0)  # TEST-NET: not ours


def test_cpu_binding_shares_and_bad_settings(monkeypatch):
    from keras_dist._src.cluster import launcher

    share = launcher.core_share
    assert [share({0, 1}, r, 2) for r in (0, 1)] == [[0], [1]]
    assert share(range(8), 3, 4) == [6, 7] and share({3, 5, 9}, 1, 2) == [5]
    assert share({0}, 0, 2) == []  # fewer cores than ranks: no share
    monkeypatch.setenv("KERAS_DIST_CPU_BINDING", "numa")
    with pytest.raises(ValueError, match="auto, exclusive, none"):
        launcher.cpu_binding()
    monkeypatch.setenv("KERAS_DIST_CPU_BINDING", "none")
    before = os.sched_getaffinity(0)
    assert launcher.bind_to_cores(0, 2) is None
    assert os.sched_getaffinity(0) == before
    monkeypatch.setenv("KERAS_DIST_CPU_BINDING", "exclusive")
    with pytest.raises(ValueError, match="a core per rank"):
        launcher.bind_to_cores(0, len(before) + 1)
    assert os.sched_getaffinity(0) == before


# A CPU rank's allocator: freed memory kept for the next step
# (`tests.utils.MALLOC_PROBE` counts the faults of a step-like round).
_ALLOCATOR_PROBE = """
import importlib.util, json, sys

spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
before = faults_per_round()
tuned = allocator.tune_allocator()
print(json.dumps({"before": before, "tuned": tuned,
                  "after": faults_per_round()}))
"""


def _allocator_probe(tmp_path, **env):
    from tests.utils import MALLOC_PROBE

    script = tmp_path / "probe.py"
    script.write_text(MALLOC_PROBE + _ALLOCATOR_PROBE)
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in allocator.USER_VARIABLES
        and k != allocator.ENV_CPU_ALLOCATOR
    }
    proc = subprocess.run(
        [sys.executable, str(script), allocator.__file__],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.skipif(allocator.glibc() is None, reason="glibc's malloc only")
def test_cpu_allocator_keeps_freed_memory(tmp_path, monkeypatch):
    tuned = _allocator_probe(tmp_path)
    assert tuned["tuned"] is True
    assert tuned["before"] > 5000, tuned  # 12,288 pages a round
    assert tuned["after"] < 100, tuned
    # Opted out, or the user's own MALLOC_* setting: malloc left alone.
    for env in (
        {"KERAS_DIST_CPU_ALLOCATOR": "none"},
        {"MALLOC_ARENA_MAX": "2", "MALLOC_TRIM_THRESHOLD_": "131072"},
    ):
        untouched = _allocator_probe(tmp_path, **env)
        assert untouched["tuned"] is False, env
        assert untouched["after"] > 5000, (env, untouched)
    monkeypatch.setenv("KERAS_DIST_CPU_ALLOCATOR", "jemalloc")
    with pytest.raises(ValueError, match="not one of auto, none"):
        allocator.tune_allocator()


@pytest.mark.parametrize(
    "argv0, main_file", [("-", "<stdin>"), ("", "<stdin>"), ("-", None)]
)
def test_relaunch_refuses_a_program_read_from_stdin(
    monkeypatch, argv0, main_file
):
    # `python - < train.py` re-ran as `python -`: the children read an
    # exhausted stdin, ran nothing, and rank 0 waited 120 s for them.
    from keras_dist._src.cluster import launcher

    main = type(sys)("__main__")
    if main_file:
        main.__file__ = main_file
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [argv0])
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-"])
    monkeypatch.delenv(launcher.ENV_NO_LAUNCH, raising=False)
    with pytest.raises(RuntimeError, match="read from standard input") as e:
        launcher.relaunch_command()
    assert "keras-dist launch --nproc-per-node N train.py" in str(e.value)
