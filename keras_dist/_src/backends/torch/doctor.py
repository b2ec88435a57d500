"""What `keras-dist doctor` checks on torch: the framework's versions and
one all-reduce over the devices `MirroredStrategy()` would use."""

from __future__ import annotations

import os


def framework_versions() -> dict:
    """torch's version and the CUDA it was built with (None: a CPU build)."""
    import torch

    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda}


def all_reduce_check(devices: list[str]) -> tuple[float, float, str]:
    """An all-reduce in a one-process gloo group: on torch each device is a
    process, and the doctor starts none."""
    import datetime
    import tempfile

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a torch process group already runs here")
    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
        try:
            value = torch.ones(1)
            dist.all_reduce(value)
            return float(value[0]), 1.0, "a gloo group of 1 process"
        finally:
            dist.destroy_process_group()
