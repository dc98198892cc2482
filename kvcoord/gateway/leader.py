"""Leader election for ``kvcoord epp`` replicas, over an exclusive lock on a file (``--leader-lock``).

The Inference Extension's and llm-d's pickers elect a leader with a Kubernetes ``coordination.k8s.io``
Lease when started with ``--ha-enable-leader-election``: readiness passes on the leader only, so the
gateway sends every request to it, and a standby takes over when the lease lapses. kvcoord watches no
Kubernetes objects, so the lease here is ``flock(2)`` on a file every replica names: the holder is the
leader; the kernel drops the lock when its process dies, and a standby takes it at its next try (every
node-list refresh). That holds for replicas on one host or on a file system whose locks all of them see
(a local volume; NFS v4 locks; not every network file system). Without the flag every replica is ready
(active-active, llm-d's ``--ha-enable-leader-election=false``): reservations share their picks.
"""

from __future__ import annotations

import fcntl
import logging
import os

__all__ = ["FileLeader"]

log = logging.getLogger("kvcoord.gateway.epp")


class FileLeader:
    """The lock on ``path``: :meth:`try_acquire` until it is held, :meth:`release` at shutdown."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._warned = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if it is free; True while this process holds it. Errors are logged once."""
        if self._fd is not None:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("--leader-lock %s: cannot open it (%s): not the leader, not ready", self.path,
                            exc.strerror or exc)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        log.warning("leader now (lock %s held): readiness SERVING", self.path)
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
