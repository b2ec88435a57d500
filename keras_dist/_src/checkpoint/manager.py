"""Saving and restoring whole training states: collective, atomic.

`CheckpointManager` owns one checkpoint directory. Every process calls
`save` and `restore` at the same point of the program (they are
collective). In a job of one process whose variables are whole the state
is written as one file (format 1, `format.write`); in a job of several,
or with variables split over devices, every process writes the pieces it
owns (the shards of its variables: nothing is gathered from
other processes) and the chief writes the metadata and commits once all
have written (format 2, `shards`). On restore the chief picks the newest
checkpoint that verifies and broadcasts its step; then every process reads
the regions its own variables hold (so the directory must be shared by all
processes, e.g. a shared filesystem).

Asynchronous saving copies the state to host memory on the calling
(training) thread, then writes it in a background thread while training
goes on. The next save, `wait`, the end of `fit` (in `BackupAndRestore`)
and the exit of the process wait for the write in flight.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import warnings

from keras_dist._src.checkpoint import format as fmt
from keras_dist._src.checkpoint import runtime_glue, shards, state


class CheckpointNotFoundError(fmt.CheckpointError, FileNotFoundError):
    """No complete checkpoint exists where one was asked for."""


class CheckpointManager:
    """Writes, lists, prunes and restores checkpoints in one directory.

    Args:
        directory: where ``ckpt-<step>`` directories are kept.
        keep: how many of the newest complete checkpoints to keep (older
            ones are deleted after each save); None keeps all.
        async_save: write in a background thread (see the module doc).
        runtime: the `Runtime` to coordinate processes; by default the
            runtime of the model passed to `save`/`restore`.
    """

    def __init__(self, directory, keep=None, async_save=False, runtime=None):
        if not directory:
            raise ValueError("A checkpoint directory is required.")
        if keep is not None and int(keep) < 1:
            raise ValueError(f"keep must be None or >= 1; got {keep!r}.")
        self.directory = os.fspath(directory)
        self.keep = None if keep is None else int(keep)
        self.async_save = bool(async_save)
        self._runtime = runtime
        self._writer: _Writer | None = None
        self._pending = False
        #: Seconds the chief waits for the other processes' pieces.
        self.shard_timeout = 1800.0
        self.last_save_seconds = None  # time the caller was blocked
        self.last_write_seconds = None  # time of the whole write

    def runtime(self, model=None):
        """The runtime coordinating this manager's processes."""
        if self._runtime is None:
            return runtime_glue.runtime_of(model)
        return self._runtime

    # -- saving --
    def save(self, model, step, position=None, extra_arrays=None, extra=None):
        """Saves `model`'s training state as ``ckpt-<step>`` (collective).

        Args:
            model: a built Keras model (its variables, optimizer, metrics).
            step: the global step that names the checkpoint.
            position: dict stored as the training position.
            extra_arrays: more ``{key: array}`` to store.
            extra: more JSON metadata (under ``"user"``).

        Returns:
            The path the checkpoint has (or will have, when asynchronous).
        """
        runtime = self.runtime(model)
        start = time.perf_counter()
        self.wait(model)
        if runtime.is_chief:
            # No write into the directory is in flight now (the wait is
            # collective): what an interrupted one left goes.
            fmt.clean_temporaries(self.directory)
        path = os.path.join(self.directory, f"{fmt.PREFIX}{int(step)}")
        # Every process exports its own parts (no gather; on TensorFlow
        # reading a sync-on-read variable is a collective all make).
        entries = state.export_variables(model, runtime.is_chief)
        if runtime.world_size > 1:
            _take_chief_keys(runtime, entries)
        metadata = None
        if runtime.is_chief:
            extras = state.capture_rng()
            extras.update(extra_arrays or {})
            entries += [state.whole(k, v) for k, v in extras.items()]
            metadata = {
                "step": int(step),
                "created": time.time(),
                "versions": state.versions(),
                "strategy": runtime_glue.describe(model, runtime),
                "position": dict(position or {"global_step": int(step)}),
                "user": dict(extra or {}),
            }
        if runtime.world_size > 1 or any(_split(e) for e in entries):
            self._save_sharded(runtime, int(step), entries, metadata)
        elif runtime.is_chief:
            arrays = {e["key"]: state.assemble(e) for e in entries}
            job = _Writer(self, int(step), arrays, metadata)
            if self.async_save:
                self._writer = job.start()
            else:
                job.run()
                job.raise_error()
        if self.async_save:
            self._pending = True
        elif runtime.world_size <= 1:
            runtime.barrier("keras_dist/checkpoint/saved")
        self.last_save_seconds = time.perf_counter() - start
        return path

    def _save_sharded(self, runtime, step, entries, metadata) -> None:
        """Every process writes its pieces; the chief commits (format 2)."""
        token = ""
        if runtime.is_chief:
            try:
                token = shards.begin(self.directory, step)
            except fmt.CheckpointError as error:
                token = f"!{error}"
            except OSError as error:
                token = (
                    "!the chief could not create its directory "
                    f"({type(error).__name__}: {error})."
                )
        token = runtime.broadcast(token, 0)
        if token.startswith("!"):
            raise fmt.CheckpointError(
                f"Cannot write checkpoint {step} into {self.directory!r}: "
                f"{token[1:]}"
            )
        self._check_every_process_sees(runtime, step, token)
        job = _ShardWriter(self, step, token, runtime, entries, metadata)
        if self.async_save:
            self._writer = job.start()
            return
        job.run()
        failure = runtime.broadcast(
            "" if job.error is None or not runtime.is_chief else str(job.error),
            0,
        )
        job.raise_error()
        if failure:
            raise fmt.CheckpointError(
                f"Writing checkpoint {step} into {self.directory!r} failed "
                f"on the chief (process 0), which commits it: {failure}"
            )

    def _check_every_process_sees(self, runtime, step, token) -> None:
        """Fails on every process, before any writes, when one cannot see
        the temporary directory the chief created (a directory that is not
        shared, or a path that differs between processes): the chief would
        otherwise wait `shard_timeout` for pieces that never come."""
        blind = _blind_processes(
            runtime, shards.temp_path(self.directory, step, token)
        )
        if not blind:
            return
        if runtime.is_chief:
            shards.abort(self.directory, step, token)
        paths = runtime.all_gather(os.path.abspath(self.directory))
        if len(set(paths)) > 1:
            where = ", ".join(
                f"process {rank}: {path!r}" for rank, path in enumerate(paths)
            )
            hint = (
                f"The processes were given different directories ({where}). "
                "Pass every process the same path (one made with "
                "tempfile.mkdtemp() differs in every process)."
            )
        else:
            hint = (
                "The directory must be on a filesystem every process sees "
                "(NFS, Lustre, a shared volume); point it there."
            )
        raise fmt.CheckpointError(
            f"Cannot write checkpoint {step}: process(es) {blind} cannot see "
            "the temporary directory the chief (process 0) created for it "
            f"in {self.directory!r}. {hint}"
        )

    def wait(self, model=None) -> None:
        """Waits for the asynchronous save in flight (collective).

        Raises:
            CheckpointError: if that save failed.
        """
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        if self._pending:
            self._pending = False
            self.runtime(model).barrier("keras_dist/checkpoint/async")
        if writer is not None:
            writer.raise_error()

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous save is being written."""
        return self._writer is not None and self._writer.is_alive()

    # -- finding and restoring --
    def latest(self) -> str | None:
        """The newest complete checkpoint's path, or None."""
        return fmt.latest(self.directory)

    def all(self) -> list[str]:
        """Every complete, valid checkpoint's path, newest first.

        Each is checked as `restore` checks it (`format.verify`); invalid
        ones are left out without a warning.
        """
        out = []
        for path in fmt.candidates(self.directory):
            try:
                fmt.verify(path)
            except fmt.CheckpointError:
                continue
            out.append(path)
        return out

    def load(self, model=None, path=None):
        """Finds and loads the newest checkpoint that verifies (collective).

        Damaged checkpoints are skipped with a warning. Nothing is assigned
        to the model.

        Args:
            model: the model whose runtime coordinates processes.
            path: a ``ckpt-<step>`` directory to load instead of the newest.

        Returns:
            ``(path, metadata, arrays)``, or None when there is none.
        """
        runtime = self.runtime(model)
        self.wait(model)
        found = None
        if runtime.is_chief:
            found = _load_newest(self.directory, path)
        step = found[1]["step"] if found else -1
        step = int(runtime.broadcast(int(step), root=0))
        if step < 0:
            return None
        if found is None:  # another process: the chief verified it
            if path is None:
                path = os.path.join(self.directory, f"{fmt.PREFIX}{step}")
            path = os.fspath(path)
        else:
            path = found[0]
        blind = _blind_processes(runtime, path)
        if blind:
            raise fmt.CheckpointError(
                f"Cannot restore checkpoint {step}: process(es) {blind} "
                f"cannot see it (at {path!r} on this process), which the "
                "chief (process 0) found in its directory. Every process "
                "must be given the same directory, on a filesystem all of "
                "them see."
            )
        if found is None:
            metadata = fmt.read_metadata(path)
            found = (path, metadata, _open(path, metadata, verify=False))
        return found

    def restore(self, model, path=None, restore_rng=True) -> dict:
        """Restores `model` from the newest (or the given) checkpoint.

        Assigns the model's, optimizer's and metrics' variables and, with
        `restore_rng`, the global random generators' states.

        Returns:
            The checkpoint's metadata, with its ``"path"``.

        Raises:
            CheckpointNotFoundError: when there is no complete checkpoint.
            CheckpointMismatchError: naming variables that do not match.
        """
        state.check_built(model)
        found = self.load(model, path)
        if found is None:
            raise CheckpointNotFoundError(
                f"No complete checkpoint in {self.directory!r}."
            )
        path, metadata, arrays = found
        try:
            apply(model, arrays)
        finally:
            if hasattr(arrays, "close"):
                arrays.close()
        if restore_rng:
            state.restore_rng(state.rng_arrays(arrays))
        return dict(metadata, path=path)

    def remove_all(self, model=None) -> None:
        """Deletes every checkpoint and the directory (chief; collective)."""
        runtime = self.runtime(model)
        self.wait(model)
        if runtime.is_chief and os.path.isdir(self.directory):
            for path in fmt.candidates(self.directory):
                fmt.remove(path)
            fmt.clean_temporaries(self.directory)
            try:
                os.rmdir(self.directory)
            except OSError:
                pass  # other files live there: leave them
        runtime.barrier("keras_dist/checkpoint/removed")


def apply(model, arrays: dict, metrics: bool = True) -> None:
    """Assigns checkpoint `arrays` to `model`'s variables.

    The model's and the optimizer's variables must match. The metrics'
    state (which `fit` and `evaluate` reset when they start) is restored
    when `metrics` is true and the model's metrics are built and match.

    Raises:
        CheckpointMismatchError: naming variables that do not match.
    """
    state.check_built(model)
    state.ensure_optimizer_built(model)
    pairs = state.match(model, arrays, groups=("model", "optimizer"))
    if metrics:
        try:
            pairs += state.match(model, arrays, groups=("metrics",))
        except fmt.CheckpointMismatchError:
            pass  # e.g. compiled metrics not built before the first step
    with runtime_glue.scope_of(model):
        state.assign(pairs)


def _split(entry) -> bool:
    """Whether an exported value comes in several pieces (a layout)."""
    pieces = entry["pieces"]
    return len(pieces) != 1 or list(pieces[0][1].shape) != entry["shape"]


def _open(path, metadata, verify=True):
    """The arrays of a checkpoint: NumPy arrays (format 1), or those of a
    sharded one (format 2), whose variables are read part by part."""
    if metadata["format_version"] == fmt.SHARDED_VERSION:
        if verify:
            fmt.verify(path)
        return fmt.open_arrays(path, metadata)
    return fmt.load_arrays(path, metadata, verify=verify)


def _blind_processes(runtime, path) -> list:
    """The processes that cannot see directory `path`, [] when every one
    can (collective: one all-reduce, and a gather only when one cannot)."""
    sees = int(os.path.isdir(path))
    if runtime.all_reduce(sees, "min"):
        return []
    return [
        rank for rank, seen in enumerate(runtime.all_gather(sees)) if not seen
    ]


def _load_newest(directory, path=None):
    if path is not None:
        paths = [os.fspath(path)]
    elif fmt.step_of(directory) is not None and os.path.exists(
        os.path.join(directory, fmt.COMMIT_FILE)
    ):
        paths = [directory]
    else:
        for name in fmt.partial_writes(directory):
            warnings.warn(
                f"Ignoring {os.path.join(directory, name)}: an interrupted "
                "(partial) checkpoint write.",
                stacklevel=4,
            )
        paths = fmt.candidates(directory)
    for candidate in paths:
        try:
            metadata = fmt.read_metadata(candidate)
            arrays = _open(candidate, metadata, verify=True)
        except fmt.CheckpointError as error:
            if path is not None:
                raise
            warnings.warn(
                f"Skipping checkpoint {candidate}: {error}", stacklevel=4
            )
            continue
        return candidate, metadata, arrays
    return None


class _Writer:
    """Writes one snapshot (in the calling thread or a background one)."""

    def __init__(self, manager, step, arrays, metadata):
        self.manager = manager
        self.step = step
        self.arrays = arrays
        self.metadata = metadata
        self.error = None
        self._thread = None

    def run(self) -> None:
        start = time.perf_counter()
        try:
            fmt.write(
                self.manager.directory, self.step, self.arrays, self.metadata
            )
            if self.manager.keep is not None:
                fmt.keep_last(self.manager.directory, self.manager.keep)
        except BaseException as error:  # noqa: BLE001 - re-raised by wait
            self.error = error
        finally:
            self.arrays = None
            self.manager.last_write_seconds = time.perf_counter() - start

    def _run_in_background(self) -> None:
        _lower_priority()
        self.run()

    def start(self) -> _Writer:
        self._thread = threading.Thread(
            target=self._run_in_background,
            name="keras_dist-checkpoint",
            daemon=True,
        )
        _IN_FLIGHT.add(self)
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        _IN_FLIGHT.discard(self)

    def raise_error(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise fmt.CheckpointError(
                f"Writing checkpoint {self.step} into "
                f"{self.manager.directory!r} failed: {error}"
            ) from error


class _ShardWriter(_Writer):
    """Writes this process's pieces of a sharded checkpoint; the chief's
    also waits for every other process's and commits (no collective, so
    that it may run in a background thread)."""

    def __init__(self, manager, step, token, runtime, entries, metadata):
        super().__init__(manager, step, None, metadata)
        self.token = token
        self.rank = int(runtime.rank)
        self.world_size = int(runtime.world_size)
        self.is_chief = bool(runtime.is_chief)
        self.entries = entries

    def run(self) -> None:
        start = time.perf_counter()
        directory = self.manager.directory
        temp = shards.temp_path(directory, self.step, self.token)
        try:
            shards.write_own(temp, self.rank, self.entries)
        except BaseException as error:  # noqa: BLE001 - re-raised by wait
            self.error = error
            if self.is_chief:
                shards.abort(directory, self.step, self.token)
            else:
                shards.write_failure(
                    temp, self.rank, f"{type(error).__name__}: {error}"
                )
        finally:
            self.entries = None
        try:
            if self.is_chief and self.error is None:
                shards.commit(
                    directory,
                    self.step,
                    self.token,
                    self.world_size,
                    self.metadata,
                    timeout=self.manager.shard_timeout,
                )
                if self.manager.keep is not None:
                    fmt.keep_last(directory, self.manager.keep)
        except BaseException as error:  # noqa: BLE001 - re-raised by wait
            self.error = error
        finally:
            self.manager.last_write_seconds = time.perf_counter() - start


_IN_FLIGHT: set = set()
BACKGROUND_NICE = 10


def _lower_priority() -> None:
    """Gives the calling thread a lower CPU priority (Linux: per thread).

    The background write (checksum, zip CRC, copies into the kernel) then
    yields the cores to the training step instead of slowing it down.
    """
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(current, BACKGROUND_NICE))
    except (AttributeError, OSError):  # not Linux, or not allowed
        pass


@atexit.register
def _wait_at_exit() -> None:
    """A process does not end while a checkpoint is being written."""
    for writer in list(_IN_FLIGHT):
        writer.join()


def _take_chief_keys(runtime, entries) -> None:
    """Keys every process's pieces as the chief keys them (collective).

    A key holds the variable's path, and a layer's name is numbered in its
    process: one that built other layers first (a reference model on the
    chief alone) calls the same layer ``dense_10`` where another calls it
    ``dense``, and the pieces of one variable came under two keys (the
    commit refused them). The variables agree in order and shape on every
    process, so each takes the chief's key of its n-th variable; where
    they do not, every process raises.
    """
    import json

    mine = [[e["key"], list(e["shape"])] for e in entries]
    chief = json.loads(runtime.broadcast(json.dumps(mine), 0))
    shapes = [shape for _, shape in chief]
    differs = shapes != [shape for _, shape in mine]
    if runtime.all_reduce(int(differs), "max"):
        where = "another process's"
        if differs:
            where = f"this process's ({len(mine)} variables: {mine[:3]}...)"
        raise fmt.CheckpointError(
            "Cannot checkpoint: the processes' models differ. The chief "
            f"has {len(chief)} variables ({chief[:3]}...; [key, shape]), "
            f"{where} do not match them in order and shape. Build the same "
            "model on every process."
        )
    for entry, (key, _) in zip(entries, chief, strict=True):
        entry["key"] = key
