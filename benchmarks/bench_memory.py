"""Peak resident memory per rank at every stage of training (issue #46).

The model: ``Input(W)`` -> 6 x ``Dense(W)`` -> ``Dense(16)``, Adam, MSE,
global batch 64, 8 steps an epoch. Every run starts in fresh processes and
records, on every rank, the peak resident memory (``VmHWM`` from
``/proc/self/status``) of each stage:

``baseline`` (imports, TensorFlow's included where Keras loads it,
process group or JAX job joined, strategy and data made), ``build``
(variables created), ``compile``, ``first_step`` (one step of ``fit``:
Keras builds the optimizer's slots there), ``steady`` (one more epoch),
``save`` (`keras_dist.checkpoint.save`; FSDP2:
``torch.distributed.checkpoint``) and ``restore`` (into the same model).

The peak is reset at the start of each stage by writing ``5`` to
``/proc/self/clear_refs``, so a stage's figure is the most the process held
during that stage. Children run with ``MALLOC_MMAP_THRESHOLD_=65536``, so
that large buffers are returned to the system when freed and the peak is
live memory, not glibc's retained heap.

Each run is set against the ideal above the rank's baseline,

    ideal = devices_per_process * (state / S + gradients / S) + largest

with state = parameters + optimizer slots (Adam: 3 P), gradients = P,
S = the number of devices the state is split over (1 for replicated runs)
and ``largest`` = the largest single variable (the transient a rank may
hold while one variable is whole). ``ratio`` = peak above baseline /
ideal. torch runs have one device a process; JAX runs in one process hold
all its devices' shares, so their figure is the process's, not a device's
(``describe`` gives the bytes per device).

Runs (``--runs``): torch ``keras`` (plain Keras, one process), ``kd_mirrored``,
``kd_sdp``, ``kd_mp`` (keras_dist on N gloo processes started by
``keras_dist.launch``) and ``fsdp`` (torch ``fully_shard`` with meta-device
init, a plain torch model of the same shapes, Adam); JAX ``jax_kd_mirrored``,
``jax_kd_sdp``, ``jax_kd_mp`` and ``jax_keras_mp`` (Keras's own
``keras.distribution.ModelParallel``) in one process of 4 simulated devices,
and ``jax2_kd_sdp``, ``jax2_kd_mp`` on 2 processes x 2 devices.

Run::

    python benchmarks/bench_memory.py [--width 1024] [--procs 2,4] \\
        [--runs torch|jax|all|NAME,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

HIDDEN = 6
OUT = 16
BATCH = 64
STEPS = 8
STAGES = (
    "baseline",
    "build",
    "compile",
    "first_step",
    "steady",
    "save",
    "restore",
)
MiB = 2**20

TORCH_RUNS = ("keras", "kd_mirrored", "kd_sdp", "kd_mp", "fsdp")
JAX_RUNS = ("jax_kd_mirrored", "jax_kd_sdp", "jax_kd_mp", "jax_keras_mp")
JAX2_RUNS = ("jax2_kd_sdp", "jax2_kd_mp")
# Runs whose state is split over every device (S = all devices).
SHARDED = {"kd_sdp", "kd_mp", "fsdp", "jax_kd_sdp", "jax_kd_mp"}
SHARDED |= {"jax_keras_mp", "jax2_kd_sdp", "jax2_kd_mp"}


# -- measuring ------------------------------------------------------------
class Recorder:
    """Per-stage peaks of this process, written to a JSON file at the end."""

    def __init__(self, path):
        self.path = path
        self.stages = {}
        self.resettable = _reset_peak()
        self.extra = {}

    def stage(self, name):
        """Records the peak of the stage that ends now; starts the next."""
        self.stages[name] = {
            "peak": _vm("VmHWM"),
            "rss_after": _vm("VmRSS"),
        }
        _reset_peak()

    def write(self):
        rank = int(os.environ.get("RANK", "0"))
        data = {"rank": rank, "resettable": self.resettable}
        data.update(stages=self.stages, **self.extra)
        with open(f"{self.path}-rank{rank}.json", "w") as f:
            json.dump(data, f)


def _vm(field):
    """`field` of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        match = re.search(rf"{field}:\s+(\d+) kB", f.read())
    return int(match.group(1)) * 1024


def _reset_peak():
    """Resets VmHWM to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- the model ------------------------------------------------------------
def _data(width, rank=0, world=1):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, width)).astype("float32")
    y = rng.normal(size=(BATCH * STEPS, OUT)).astype("float32")
    return x, y


def _keras_model(width):
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    h = inputs
    for i in range(HIDDEN):
        h = keras.layers.Dense(width, activation="tanh", name=f"d{i}")(h)
    return keras.Model(inputs, keras.layers.Dense(OUT, name="out")(h))


def _layouts(layout_map):
    """Megatron style: even layers split by columns, odd ones by rows."""
    for i in range(HIDDEN):
        if i % 2 == 0:
            layout_map[f"d{i}/kernel"] = (None, "model")
            layout_map[f"d{i}/bias"] = ("model",)
        else:
            layout_map[f"d{i}/kernel"] = ("model", None)
    layout_map["out/kernel"] = ("model", None)
    return layout_map


def _strategy(run):
    import keras_dist

    if run.endswith("mirrored"):
        return keras_dist.MirroredStrategy()
    if run.endswith("sdp"):
        return keras_dist.ShardedDataParallel()
    if run.endswith("kd_mp"):
        # torch: one device a process; JAX: 4 devices in 1 or 2 processes
        # (counted without asking JAX, which must not start before the
        # strategy joins the job).
        n = int(os.environ.get("WORLD_SIZE", "1")) if run == "kd_mp" else 4
        mesh = keras_dist.DeviceMesh((1, n), ("batch", "model"))
        return keras_dist.ModelParallel(
            _layouts(keras_dist.LayoutMap(mesh)), "batch"
        )
    return None


def _keras_distribution():
    """Keras's own `ModelParallel` over every JAX device."""
    import jax
    import keras

    dist = keras.distribution
    n = jax.device_count()
    mesh = dist.DeviceMesh((1, n), ["batch", "model"], jax.devices())
    layout_map = _layouts(dist.LayoutMap(mesh))
    return dist.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def run_keras_like(args, recorder):
    """Keras's `fit` under keras_dist, Keras's own distribution or none."""
    import contextlib

    import keras

    import keras_dist

    # Keras's set_random_seed imports TensorFlow (about 440 MiB): in the
    # baseline, not in the first stage.
    keras.utils.set_random_seed(0)
    strategy = _strategy(args.run)
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    if args.run == "jax_keras_mp":
        keras.distribution.set_distribution(_keras_distribution())
    x, y = _data(args.width)
    recorder.stage("baseline")
    with scope:
        model = _keras_model(args.width)
        recorder.stage("build")
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        recorder.stage("compile")

    def fit(steps):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            steps_per_epoch=steps,
            shuffle=False,
            verbose=0,
        )

    fit(1)
    recorder.stage("first_step")
    fit(STEPS)
    recorder.stage("steady")
    if strategy is not None:
        rows = strategy.describe(model, print_fn=None)
        recorder.extra["describe_bytes_per_device"] = sum(
            r["bytes_per_device"] for r in rows if r["group"] != "metrics"
        )
        recorder.extra["expected_peak"] = rows.expected_peak
        recorder.stage("describe")
    if args.run.startswith("jax2"):
        # What attaching a model costs on several JAX processes: every
        # variable's chief value given to every process (issue #46).
        strategy.extended.sync_variables(model.variables)
        recorder.stage("sync_variables")
    directory = os.path.join(args.out, f"ckpt-{args.run}")
    keras_dist.checkpoint.save(model, directory)
    recorder.stage("save")
    keras_dist.checkpoint.restore(model, directory)
    recorder.stage("restore")


def run_fsdp(args, recorder):
    """torch FSDP2: meta-device init, `fully_shard` per layer, Adam."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    x, y = _data(args.width)
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    recorder.stage("baseline")
    width = args.width
    with torch.device("meta"):
        layers = [nn.Linear(width, width) for _ in range(HIDDEN)]
        model = nn.Sequential(
            *[m for layer in layers for m in (layer, nn.Tanh())],
            nn.Linear(width, OUT),
        )
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model:
            if isinstance(module, nn.Linear):
                module.reset_parameters()
    recorder.stage("build")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    recorder.stage("compile")
    local = BATCH // world

    def step(i):
        lo = (i % STEPS) * BATCH + rank * local
        optimizer.zero_grad()
        outputs = model(x[lo : lo + local])
        loss = torch.mean((outputs - y[lo : lo + local]) ** 2)
        loss.backward()
        optimizer.step()

    step(0)
    recorder.stage("first_step")
    for i in range(1, STEPS + 1):
        step(i)
    recorder.stage("steady")
    directory = os.path.join(args.out, "ckpt-fsdp")
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optim": optim_state}, checkpoint_id=directory
    )
    del model_state, optim_state
    recorder.stage("save")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    del state, model_state, optim_state
    recorder.stage("restore")
    dist.destroy_process_group()


# -- the driver -----------------------------------------------------------
def _sizes(width):
    """(parameter bytes, largest variable's bytes) of the model."""
    kernels = [width * width] * HIDDEN + [width * OUT]
    biases = [width] * HIDDEN + [OUT]
    return 4 * (sum(kernels) + sum(biases)), 4 * width * width


def _launch(run, width, procs, out):
    """Runs `run` in fresh processes; returns every rank's record."""
    jax = run.startswith("jax")
    env = dict(
        os.environ,
        KERAS_BACKEND="jax" if jax else "torch",
        MALLOC_MMAP_THRESHOLD_="65536",
        OMP_NUM_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    for name in ("KERAS_DIST_CPU_DEVICES", "XLA_FLAGS", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    script = [os.path.abspath(__file__), "--run", run, "--width", str(width)]
    script += ["--out", out]
    if run == "jax_keras_mp":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        command = [sys.executable, *script]
    elif run.startswith("jax_"):
        env["KERAS_DIST_CPU_DEVICES"] = "4"
        command = [sys.executable, *script]
    elif procs == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "keras_dist.launch"]
        command += ["--nproc-per-node", str(procs)]
        if run.startswith("jax2"):
            command += ["--cpu-devices-per-process", "2"]
        command += script
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{run} (x{procs}) failed:\n{tail}")
    records = []
    for rank in range(procs):
        with open(os.path.join(out, f"{run}-rank{rank}.json")) as f:
            records.append(json.load(f))
    return records


def _summarise(run, width, procs, records):
    params, largest = _sizes(width)
    devices = 4 if run.startswith("jax") else procs
    local = devices // procs
    split = devices if run in SHARDED else 1
    state, gradients = 3 * params, params
    ideal = local * (state + gradients) / split + largest
    stages = {}
    for name in STAGES[1:]:
        above = [
            r["stages"][name]["peak"] - r["stages"]["baseline"]["rss_after"]
            for r in records
        ]
        stages[name] = max(above)
    peak = max(stages.values())
    # sync_variables alone, above what the process held before it.
    sync = [
        r["stages"]["sync_variables"]["peak"]
        - r["stages"]["describe"]["rss_after"]
        for r in records
        if "sync_variables" in r["stages"]
    ]
    return {
        "run": run,
        "backend": "jax" if run.startswith("jax") else "torch",
        "width": width,
        "processes": procs,
        "devices": devices,
        "split_over": split,
        "param_bytes": params,
        "largest_bytes": largest,
        "ideal_above_baseline": ideal,
        "baseline": max(r["stages"]["baseline"]["rss_after"] for r in records),
        "above_baseline": stages,
        "peak_above_baseline": peak,
        "ratio": peak / ideal,
        "sync_variables_transient": max(sync) if sync else None,
        "describe_bytes_per_device": records[0].get(
            "describe_bytes_per_device"
        ),
        "expected_peak": records[0].get("expected_peak"),
        "ranks": records,
    }


def _print_table(results):
    print(
        "Peak resident memory above the rank's baseline, MiB (the most over "
        "ranks;\nVmHWM reset at each stage; children run with "
        "MALLOC_MMAP_THRESHOLD_=65536,\nso the peak is live memory). "
        "ideal = per-process share of state + gradients\n+ the largest "
        "variable; ratio = peak / ideal."
    )
    for backend in ("torch", "jax"):
        rows = [r for r in results if r["backend"] == backend]
        if not rows:
            continue
        print(f"\n{backend}:")
        header = f"{'run':<16} {'W':>5} {'proc':>4} {'base':>6} "
        header += " ".join(f"{s:>10}" for s in STAGES[1:])
        header += f" {'ideal':>7} {'ratio':>6}"
        print(header)
        for r in rows:
            line = f"{r['run']:<16} {r['width']:>5} {r['processes']:>4} "
            line += f"{r['baseline'] / MiB:>6.0f} "
            line += " ".join(
                f"{r['above_baseline'][s] / MiB:>10.1f}" for s in STAGES[1:]
            )
            line += f" {r['ideal_above_baseline'] / MiB:>7.1f}"
            line += f" {r['ratio']:>6.2f}"
            print(line)
        anchors = {
            (r["width"], r["processes"]): r["ratio"]
            for r in rows
            if r["run"] == "fsdp"
        }
        for r in rows:
            anchor = anchors.get((r["width"], r["processes"]))
            if anchor and r["run"] != "fsdp":
                print(
                    f"  {r['run']} W={r['width']} N={r['processes']}: ratio "
                    f"{r['ratio']:.2f} against FSDP2's {anchor:.2f} "
                    f"({r['ratio'] / anchor:.2f}x)"
                )
        for r in rows:
            if r["sync_variables_transient"] is not None:
                print(
                    f"  {r['run']} W={r['width']}: sync_variables took "
                    f"{r['sync_variables_transient'] / MiB:.1f} MiB above "
                    "what the process held, "
                    f"{r['sync_variables_transient'] / r['largest_bytes']:.2f}"
                    " x the largest variable"
                )
        if backend == "jax":
            keras_mp = {
                r["width"]: r["peak_above_baseline"]
                for r in rows
                if r["run"] == "jax_keras_mp"
            }
            for r in rows:
                anchor = keras_mp.get(r["width"])
                if anchor and r["run"] != "jax_keras_mp":
                    print(
                        f"  {r['run']} W={r['width']}: peak "
                        f"{r['peak_above_baseline'] / anchor:.2f}x Keras's "
                        "own ModelParallel's"
                    )


def _plan(args):
    names = []
    for part in args.runs.split(","):
        if part in ("torch", "all"):
            names += list(TORCH_RUNS)
        if part in ("jax", "all"):
            names += list(JAX_RUNS) + list(JAX2_RUNS)
        if part not in ("torch", "jax", "all"):
            names.append(part)
    plan = []
    for width in [int(w) for w in str(args.width).split(",")]:
        for name in names:
            if name == "keras" or name.startswith("jax_"):
                plan.append((name, width, 1))
            elif name.startswith("jax2"):
                plan.append((name, width, 2))
            else:
                for procs in [int(p) for p in args.procs.split(",")]:
                    plan.append((name, width, procs))
    return plan


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="(internal) one run in this process")
    parser.add_argument("--out", help="(internal) where ranks write")
    parser.add_argument("--width", default="1024", help="W, or W1,W2,...")
    parser.add_argument("--procs", default="2,4", help="torch processes")
    parser.add_argument("--runs", default="all")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    if args.run:
        recorder = Recorder(os.path.join(args.out, args.run))
        args.width = int(args.width)
        if args.run == "fsdp":
            run_fsdp(args, recorder)
        else:
            run_keras_like(args, recorder)
        recorder.write()
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as root:
        for name, width, procs in _plan(args):
            out = os.path.join(root, f"{name}-{width}-{procs}")
            os.makedirs(out)
            print(f"running {name} W={width} x{procs}", flush=True)
            records = _launch(name, width, procs, out)
            results.append(_summarise(name, width, procs, records))
            if args.json:  # after every run: a long job keeps what it has
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    _print_table(results)


if __name__ == "__main__":
    main()
