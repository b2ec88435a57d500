"""The directory of a `BackupAndRestore`: claimed with a marker file.

A missing or empty directory is claimed with `OWNER_FILE` (written
atomically); one with the marker is resumed from; anything else is
refused, untouched, so that the callback never reads or deletes files it
did not write.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time

from keras_dist._src.checkpoint import format as fmt

#: The file that marks a directory as a `BackupAndRestore` backup: written
#: (atomically) when the callback creates or claims an empty directory.
OWNER_FILE = "keras_dist_backup.json"
OWNER = "keras_dist.callbacks.BackupAndRestore"
_OWNER_TEMP = re.compile(r"^\.keras_dist_backup\.json\.tmp-[0-9a-f]+$")


def _log(runtime, message: str) -> None:
    if runtime is None or runtime.is_chief:
        sys.stderr.write(f"keras_dist: {message}\n")
        sys.stderr.flush()


def _is_ours(name: str) -> bool:
    """Whether `name` is one a `BackupAndRestore` directory may hold."""
    return (
        name == OWNER_FILE
        or fmt.step_of(name) is not None
        or bool(fmt.TEMP_NAME.match(name))
        or bool(_OWNER_TEMP.match(name))
    )


def _claim(directory: str):
    """Claims `directory` for a backup, or says why not.

    Returns:
        ``(problem, owned)``: an error message or None, and the names of
        the checkpoints already there (ours when the marker is).
    """
    if os.path.lexists(directory) and not os.path.isdir(directory):
        return (
            f"BackupAndRestore's backup_dir {directory!r} is not a "
            "directory. Pass a new or empty directory.",
            [],
        )
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    if OWNER_FILE not in names:
        if names:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            return (
                f"BackupAndRestore will not use backup_dir {directory!r}: "
                f"it holds files this callback did not write ({shown}) and "
                f"no {OWNER_FILE} marker. The callback resumes from and "
                "deletes only a backup of its own, so it leaves this "
                "directory untouched. Pass a new or empty directory (e.g. "
                "a subdirectory) as backup_dir.",
                [],
            )
        os.makedirs(directory, exist_ok=True)
        _write_owner(directory)
        return None, []
    problem = _owner_problem(os.path.join(directory, OWNER_FILE))
    foreign = [n for n in names if not _is_ours(n)]
    if problem is None and foreign:
        # Put there after the claim (a ModelCheckpoint writing into the
        # same directory, say): refusing would leave a preempted job that
        # has a backup unable to resume. They are never read or removed.
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        _log(
            None,
            f"backup_dir {directory!r} also holds files BackupAndRestore "
            f"did not write ({shown}); it leaves them untouched (and so "
            "the directory at the end). Give the callback a directory of "
            "its own.",
        )
    if problem is not None:
        return (
            f"BackupAndRestore will not use backup_dir {directory!r}: "
            f"{problem}. It leaves the directory untouched; move those "
            "files away or pass a new or empty directory.",
            [],
        )
    return None, [n for n in names if fmt.step_of(n) is not None]


def _owner_problem(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(1 << 16))
    except (OSError, ValueError) as error:
        return f"its {OWNER_FILE} is unreadable ({error})"
    if not isinstance(record, dict) or record.get("owner") != OWNER:
        return f"its {OWNER_FILE} does not name {OWNER}"
    return None


def _write_owner(directory: str) -> None:
    """Writes `OWNER_FILE` atomically (a temporary file, then a rename)."""
    record = {"owner": OWNER, "format_version": 1, "created": time.time()}
    final = os.path.join(directory, OWNER_FILE)
    temp = os.path.join(directory, f".{OWNER_FILE}.tmp-{secrets.token_hex(4)}")
    try:
        fmt.write_bytes(temp, json.dumps(record).encode())
        os.replace(temp, final)
    finally:
        _remove_file(temp)
    fmt.fsync_dir(directory)


def _remove_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
