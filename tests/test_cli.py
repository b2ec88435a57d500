"""`keras-dist doctor` as a user runs it: a fresh process, the active backend.

Each test starts ``python -m keras_dist.cli doctor`` (the console script's
code) so that the device settings are applied the way a user's are: before
the backend starts, in a process that has not imported anything yet.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import keras
import pytest

BACKEND = keras.backend.backend()


def _doctor(*args, **env_updates):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KERAS_DIST_CPU_DEVICES", "XLA_FLAGS")
        and not k.startswith(("SLURM_", "OMPI_COMM_WORLD_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TF_CONFIG")
    }
    env["KERAS_BACKEND"] = BACKEND
    env.update(env_updates)
    return subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "doctor", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _cpu_only(report) -> bool:
    return all(d.startswith("cpu:") for d in report["devices"])


@pytest.mark.slow  # a fresh process: 5-10 s
def test_doctor_json_without_simulated_devices():
    out = _doctor("--json")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    report = json.loads(out.stdout)  # one report, nothing else on stdout
    assert report["backend"] == BACKEND
    assert report["problems"] == []
    assert report["versions"]["keras_dist"]
    assert report["versions"][BACKEND]
    assert report["cluster"]["environment"]["source"] == "local"
    assert report["all_reduce"]["ok"]
    if _cpu_only(report):
        # One process, one device: JAX's and TF's default, torch's without
        # simulated devices (it would start no other process).
        assert report["mirrored_strategy"]["devices"] == ["cpu:0"]
        assert report["listens"] == []  # one process: nothing listens
        if len(report["devices"]) > 1:  # torch: one CPU device a core
            # The devices row listed more than the strategy uses, unsaid.
            assert report["mirrored_strategy"]["note"].endswith(
                "KERAS_DIST_CPU_DEVICES=N or --cpu-devices N for N processes"
            )


@pytest.mark.slow  # a fresh process: 5-10 s
def test_doctor_simulates_four_devices_and_all_reduces():
    # --cpu-devices once reported one device, and on torch started 4 doctors.
    out = _doctor("--cpu-devices", "4")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.count("MirroredStrategy()") == 1  # printed once
    assert "4 replicas on cpu:0 cpu:1 cpu:2 cpu:3" in out.stdout
    assert "all-reduce           ok" in out.stdout
    assert "OK: nothing wrong found." in out.stdout
    if BACKEND == "torch":
        assert "starts 4 processes" in out.stdout
        assert (
            "CPU ranks            binding: none, allocator: glibc's malloc "
            "keeps freed memory" in out.stdout
        )
    if BACKEND == "tensorflow":
        assert "ShardedDataParallel: not available" in out.stdout
    else:  # the mesh a layout strategy would use
        assert "DeviceMesh((4,), ('batch',))" in out.stdout
        assert "4x1, 2x2, 1x4" in out.stdout


@pytest.mark.slow  # a fresh process: 5-10 s
def test_doctor_exits_non_zero_with_the_reason():
    # torchrun's variables, half set: a launcher misconfiguration; and a
    # CPU rank setting (torch's) that would stop the job at its start.
    out = _doctor(
        "--json",
        RANK="0",
        MASTER_PORT="29500",
        KERAS_DIST_CPU_ALLOCATOR="jemalloc",
    )
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["cluster"]["variables"] == {
        "MASTER_PORT": "29500",
        "RANK": "0",
    }
    assert any("WORLD_SIZE" in p for p in report["problems"])
    bad_allocator = [
        p for p in report["problems"] if "KERAS_DIST_CPU_ALLOCATOR" in p
    ]
    assert len(bad_allocator) == (BACKEND == "torch"), report["problems"]


@pytest.mark.slow  # a fresh process: 5-10 s
def test_doctor_says_what_a_local_job_listens_on():
    out = _doctor(
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="localhost",
        MASTER_PORT="29999",
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    listens = out.stdout.split("listens", 1)[1].split("all-reduce")[0]
    if BACKEND == "tensorflow":
        # TensorFlow's servers: every interface, and the doctor says so.
        assert "0.0.0.0" in listens
        assert "no setting" in listens and "firewall" in listens
    else:
        assert "rank 0: " in listens
        assert "on 127.0.0.1:29999" in listens  # localhost: loopback
        assert "0.0.0.0" not in listens and "every interface" not in listens


def test_launch_ps_options_and_task_environments():
    # `keras-dist launch --ps N --workers M`: the options, and the TF_CONFIG
    # of every task of the one-host job (no process started here).
    import argparse

    from keras_dist._src.cluster import node_launcher
    from keras_dist._src.cluster.parameter_server import ps_task_environments

    parser = argparse.ArgumentParser()
    node_launcher.add_arguments(parser)

    def config(*argv):
        return node_launcher.config_from_args(parser.parse_args(argv))

    job = config("--ps", "2", "--workers", "3", "train.py", "--epochs", "1")
    assert (job.ps, job.workers) == (2, 3)
    assert job.command == ["train.py", "--epochs", "1"]
    job.check()
    for argv in (
        ("--ps", "1", "t.py"),
        ("--workers", "2", "t.py"),
        ("--ps", "1", "--workers", "1", "--nproc-per-node", "2", "t.py"),
    ):
        with pytest.raises(ValueError, match="--ps"):
            config(*argv).check()
    # From the command line: a usage error (exit 2), not a traceback.
    proc = subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "launch", "--ps", "1"]
        + ["--workers", "1", "--nproc-per-node", "2", "t.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "error: --ps/--workers" in proc.stderr
    assert "Traceback" not in proc.stderr
    tasks = ps_task_environments(
        3, 2, base={"RANK": "0", "WORLD_SIZE": "4", "PATH": "/bin"}
    )
    assert [(kind, index) for kind, index, _ in tasks] == [
        ("ps", 0),
        ("ps", 1),
        ("worker", 0),
        ("worker", 1),
        ("worker", 2),
        ("chief", 0),
    ]
    configs = [json.loads(env["TF_CONFIG"]) for *_, env in tasks]
    cluster = configs[0]["cluster"]
    assert {k: len(v) for k, v in cluster.items()} == {
        "chief": 1,
        "worker": 3,
        "ps": 2,
    }
    assert all(c["cluster"] == cluster for c in configs)
    assert [(c["task"]["type"], c["task"]["index"]) for c in configs] == [
        (kind, index) for kind, index, _ in tasks
    ]
    addresses = [a for kind in cluster.values() for a in kind]
    assert len(set(addresses)) == 6  # a free port each, on loopback
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    for *_, env in tasks:  # not torchrun peers; TensorFlow; PATH kept
        assert "RANK" not in env and "WORLD_SIZE" not in env
        assert env["KERAS_BACKEND"] == "tensorflow"
        assert env["PATH"] == "/bin"
    with pytest.raises(ValueError, match="TensorFlow only"):
        ps_task_environments(1, 1, base={"KERAS_BACKEND": "jax"})
    with pytest.raises(ValueError, match="--workers >= 1"):
        ps_task_environments(0, 1, base={})


_FAKE_TASK = """
import json, os, socket, sys, time
config = json.loads(os.environ["TF_CONFIG"])
task, mode = config["task"], sys.argv[1]
if task["type"] == "chief":
    print("chief runs", flush=True)
    time.sleep({"ok": 0, "worker_dies": 1.5}.get(mode, 30))
    sys.exit(3 if mode == "ok" else 0)
if mode == "no_serve" and task["type"] == "worker":
    sys.exit(1)  # dies before it listens
address = config["cluster"][task["type"]][task["index"]]
host, port = address.rsplit(":", 1)
server = socket.socket()
server.bind((host, int(port)))
server.listen()
# Dies only once the launcher has seen it listen (its probe connects).
if mode == "ps_dies" and task["type"] == "ps":
    server.accept()
    sys.exit(2)
if mode == "worker_dies" and task == {"type": "worker", "index": 1}:
    server.accept()
    sys.exit(0)
time.sleep(60)
"""


@pytest.mark.multi_process
@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="backend-neutral: run in one lane only"
)
def test_launch_ps_supervision_with_plain_socket_tasks(
    tmp_path, capfd, monkeypatch
):
    # The launcher's rules, with tasks that only listen on their TF_CONFIG
    # port (no TensorFlow: a second each); tests/test_parameter_server.py
    # runs a real TensorFlow job through the same launcher.
    from keras_dist._src.cluster.parameter_server import launch_ps

    script = tmp_path / "task.py"
    script.write_text(_FAKE_TASK)
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")  # the job's backend

    def launch(mode, workers=2):
        code = launch_ps([str(script), mode], workers, 1)
        out, err = capfd.readouterr()
        return code, out, err

    code, out, err = launch("ok")  # the chief's exit code is the job's
    assert code == 3 and "[chief] chief runs" in out
    assert "the chief exited with code 3" in err
    code, out, err = launch("ps_dies")
    assert code == 2
    assert "ps task 0 exited with code 2: the variables it held" in err
    code, out, err = launch("worker_dies")
    assert code == 0, err
    assert "worker task 1 exited with code 0; tolerated" in err
    assert "(1 of 2 left)" in err
    code, out, err = launch("no_serve", workers=1)
    assert code == 1
    assert "worker task 0 exited with code 1 before it was seen" in err


@pytest.mark.parametrize("how", ["module", "command", "cli_module"])
def test_launcher_imports_neither_keras_nor_a_backend(how):
    # The launcher only starts and supervises workers: importing Keras and a
    # backend there (5.5 s here) delayed every worker's start.
    command = [sys.executable, "-X", "importtime"]
    if how == "module":
        command += ["-m", "keras_dist.launch"]
    elif how == "cli_module":
        command += ["-m", "keras_dist.cli", "launch"]
    else:
        program = os.path.join(os.path.dirname(sys.executable), "keras-dist")
        command += [program, "launch"]
    proc = subprocess.run(
        [*command, "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--nproc-per-node" in proc.stdout
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "keras_dist" in imported
    heavy = imported & {"keras", "tensorflow", "jax", "torch", "numpy"}
    assert not heavy, f"the launcher imported {sorted(heavy)}"


@pytest.mark.parametrize("argument", ["--help", "--version"])
def test_help_and_version_import_no_backend(argument):
    # `keras-dist --help` imported Keras and TensorFlow (6.5 s here, 12.7 s
    # with torch) and printed TF's start-up lines; both answer in ~0.1 s.
    import keras_dist

    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "keras_dist.cli", argument],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if argument == "--version":
        assert proc.stdout == f"keras_dist {keras_dist.__version__}\n"
    else:
        assert proc.stdout.startswith("usage: keras-dist ")
        assert "--version" in proc.stdout and "doctor" in proc.stdout
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "keras_dist" in imported
    heavy = imported & {"keras", "tensorflow", "jax", "torch", "numpy"}
    assert not heavy, f"keras-dist {argument} imported {sorted(heavy)}"


def test_launcher_reads_the_backend_from_keras_json_without_keras(tmp_path):
    # Without KERAS_BACKEND the launcher needs keras.json's backend (a
    # TensorFlow job gets TF_CONFIG); importing Keras to ask took seconds
    # and started TensorFlow in the launcher.
    script = tmp_path / "worker.py"
    script.write_text("import os; print('TF_CONFIG' in os.environ)\n")
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(tmp_path)
    seen = {}
    for backend in ("jax", "tensorflow"):
        (tmp_path / "keras.json").write_text(f'{{"backend": "{backend}"}}')
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "keras_dist.launch"]
            + ["--nproc-per-node", "1", str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        imported = {
            line.rsplit("|", 1)[-1].strip()
            for line in proc.stderr.splitlines()
            if line.startswith("import time:")  # the launcher's own
        }
        assert "keras" not in imported and "tensorflow" not in imported
        seen[backend] = proc.stdout.split()[-1]
    assert seen == {"jax": "False", "tensorflow": "True"}


def test_launch_ps_names_every_task_found_dead_in_one_poll(capfd):
    # Worker 1 and ps 0 killed between two polls (a short epoch under
    # load): both are named, the worker first; the lost ps task ends the
    # job with its code.
    from keras_dist._src.cluster.parameter_server import _supervise_ps

    class Task:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = server.getsockname()
        procs = {
            ("chief", 0): Task(None),
            ("ps", 0): Task(-signal.SIGKILL),
            ("worker", 0): Task(None),
            ("worker", 1): Task(-signal.SIGKILL),
        }
        no_restarts = {"left": 0, "used": 0}
        code, lost_ps = _supervise_ps(
            procs, dict.fromkeys(procs, address), 2, 30, None, no_restarts
        )
    err = capfd.readouterr().err
    assert code == 128 + signal.SIGKILL and lost_ps
    tolerated = err.index("worker task 1 was killed by SIGKILL; tolerated")
    assert tolerated < err.index("ps task 0 was killed by SIGKILL")
