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

from .errors import UserError


@contextmanager
def disk_full_is_a_user_error(target: Path):
    try:
        yield
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise UserError(f"the disk is full while writing {target}: free space or write elsewhere "
                            f"(nothing was kept)") from None
        raise


def save_atomically(out: Path, write: Callable[[Path], None]) -> None:
    """Call write(tmp_dir), then move tmp_dir to the directory `out` (replacing it)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with disk_full_is_a_user_error(out):
            write(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


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
