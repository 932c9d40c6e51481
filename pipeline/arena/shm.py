"""POSIX shared-memory segments (Linux /dev/shm), named so that leftovers
of a crashed process can be found and removed.

Names are `epd-<instance>-<pid>-<role>`: `instance` is the stable name of a
stage (e.g. "encoder-0"), so the stage's next incarnation removes the segments
of any earlier one whose pid is gone. We manage the files ourselves rather
than through multiprocessing.shared_memory, whose resource tracker unlinks a
segment when any process that merely attached to it exits.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "epd-"
_NAME = re.compile(r"^epd-(?P<instance>[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*)-(?P<pid>\d+)-(?P<role>[a-z][a-z0-9]*)$")


def is_segment_name(name: str) -> bool:
    """Whether `name` is one of ours (and so a plain file name in /dev/shm)."""
    return _NAME.match(name) is not None


def segment_name(instance: str, role: str, pid: int | None = None) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", instance) or not re.fullmatch(r"[a-z][a-z0-9]*", role):
        raise ValueError(f"bad segment name parts: instance={instance!r} role={role!r}")
    return f"{PREFIX}{instance}-{pid or os.getpid()}-{role}"


class ShmSegment:
    """A mapped segment. The creator unlinks it; openers only unmap."""

    def __init__(self, name: str, fd: int, nbytes: int, owner: bool) -> None:
        self.name = name
        self.nbytes = nbytes
        self.owner = owner
        try:
            self.mmap = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, name: str, nbytes: int) -> ShmSegment:
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        except OSError:
            os.close(fd)
            (SHM_DIR / name).unlink(missing_ok=True)
            raise
        return cls(name, fd, nbytes, owner=True)

    @classmethod
    def open(cls, name: str) -> ShmSegment:
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        return cls(name, fd, os.fstat(fd).st_size, owner=False)

    def close(self) -> None:
        """Unmap (callers must have dropped their tensor views first), and
        remove the name if we created it."""
        self.mmap.close()
        if self.owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments(instance: str) -> list[str]:
    """Unlink this instance's segments left by processes that no longer run."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}{instance}-*"):
        match = _NAME.match(path.name)
        if not match or match["instance"] != instance:
            continue
        pid = int(match["pid"])
        if pid != os.getpid() and not pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def our_segments() -> list[str]:
    """Every EPD segment present now (for leak checks)."""
    return sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}*"))
