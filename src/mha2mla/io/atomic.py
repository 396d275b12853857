"""Writes that leave either the old state or the complete new one, never a half-written file.

A directory is written into a temporary sibling and renamed into place; a file is written to a
temporary sibling and renamed over the target (`os.replace`, atomic on one filesystem). A full disk
while writing is a UserError, and the temporary files are removed.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from ..errors import UserError

T = TypeVar("T")


@contextmanager
def disk_full_is_a_user_error(target: Path):
    try:
        yield
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise UserError(f"the disk is full while writing {target}: free space or write elsewhere "
                            f"(nothing was kept)") from None
        raise


def check_output_dir(out, overwrite: bool) -> None:
    """A UserError where `out` exists and is not an empty directory, unless `overwrite`."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"output {out} exists and is not empty (pass --overwrite or choose another directory)")


@contextmanager
def scratch_beside(out: Path):
    """A temporary directory beside `out` (same filesystem: a rename from it is atomic), removed at the end;
    a full disk while it is open is a UserError."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with disk_full_is_a_user_error(out):
            yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_atomically(out: Path, write: Callable[[Path], T]) -> T:
    """Call write(tmp_dir), then move tmp_dir to the directory `out` (replacing it) → what write returned."""
    out = Path(out)
    with scratch_beside(out) as tmp:
        result = write(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    return result


def save_file_atomically(out: Path, write: Callable[[Path], T]) -> T:
    """Call write(tmp_dir), which makes the file tmp_dir/<out's name> (and may use tmp_dir for intermediate
    files), then rename that file to `out` → what write returned."""
    out = Path(out)
    with scratch_beside(out) as tmp:
        result = write(tmp)
        (tmp / out.name).replace(out)
    return result


def write_file_atomically(path: Path, write: Callable[[object], None], mode: str = "w") -> None:
    """Call write(file) on a temporary sibling of `path` opened with `mode`, then rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with disk_full_is_a_user_error(path), open(tmp, mode) as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
