"""Where engines registered over HTTP are kept: this process's memory (with an optional state file, so
registrations survive a restart) or the Redis index's engine records, shared by every replica."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Protocol

from kvcoord.coordinator.engines import Engine
from kvcoord.index.base import EngineRecords, Index

log = logging.getLogger("kvcoord.coordinator.engines")

__all__ = ["STATE_FILE", "EngineStore", "MemoryEngineStore", "SharedEngineStore", "open_engine_store"]


class EngineStore(Protocol):
    """Where registrations and owner keys live. Methods raise ``ConnectionError`` when it is down."""

    kept: str
    """Where registrations are kept, in words (the start-up line)."""

    async def all(self) -> dict[int, Engine]: ...

    async def swap(self, instance_id: int, old: Engine | None, new: Engine | None) -> bool:
        """Replace the registration if it still is ``old`` (None: absent); False if it changed meanwhile."""
        ...

    async def claim(self, instance_id: int, replica: str, status: str, lease: float) -> bool:
        """Become (or stay) the instance's owner for ``lease`` seconds; False when another replica is."""
        ...

    async def release(self, instance_id: int, replica: str) -> None: ...

    async def owners(self) -> dict[int, tuple[str, str]]:
        """``{instance_id: (replica, status json)}`` of the owner keys alive now."""
        ...

    async def close(self) -> None: ...


STATE_FILE = "engines.json"
"""The memory store's registrations under ``state_dir``."""


class MemoryEngineStore:
    """One process: registrations last as long as it does (as in Dynamo's indexer), or, given a
    ``state_dir``, across its restarts: each change is written to :data:`STATE_FILE` there (a temporary file
    renamed over it, so a crash leaves the old file or the new one, never half of one) before it takes
    effect, and the file is read at start. Owner keys are never kept: this process is the only owner."""

    def __init__(self, state_dir: str | None = None) -> None:
        self._engines: dict[int, Engine] = {}
        self._owners: dict[int, tuple[str, str]] = {}
        self.path = Path(state_dir, STATE_FILE) if state_dir else None
        self.kept = (f"kept in {self.path}" if self.path is not None
                     else "kept in memory only (set state_dir to keep them across restarts)")
        if self.path is not None:
            self._engines = _read_state(self.path)
            try:
                _write_state(self.path, self._engines)  # a state_dir that cannot be written fails the start
            except ConnectionError as exc:
                raise ValueError(f"state_dir: {exc}") from None

    async def all(self) -> dict[int, Engine]:
        return dict(self._engines)

    async def swap(self, instance_id: int, old: Engine | None, new: Engine | None) -> bool:
        if self._engines.get(instance_id) != old:
            return False
        engines = dict(self._engines)
        if new is None:
            engines.pop(instance_id, None)
        else:
            engines[instance_id] = new
        if self.path is not None:
            _write_state(self.path, engines)  # ConnectionError: refused, and nothing changed
        self._engines = engines
        return True

    async def claim(self, instance_id: int, replica: str, status: str, lease: float) -> bool:
        self._owners[instance_id] = (replica, status)
        return True

    async def release(self, instance_id: int, replica: str) -> None:
        self._owners.pop(instance_id, None)

    async def owners(self) -> dict[int, tuple[str, str]]:
        return {k: v for k, v in self._owners.items() if k in self._engines}

    async def close(self) -> None:
        return None


def _read_state(path: Path) -> dict[int, Engine]:
    """The registrations a state file holds (none when it does not exist yet); ValueError when it cannot
    be read or is not one: a start that would silently forget them is refused."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"state_dir: cannot create {path.parent}: {exc.strerror or exc}") from None
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ValueError(f"state_dir: cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(raw)
        listed = data.get("engines") if isinstance(data, dict) and data.get("version") == 1 else None
        if not isinstance(listed, list):
            raise ValueError("expected {\"version\": 1, \"engines\": [...]}")
        engines = [Engine.decode(json.dumps(e)) for e in listed]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"state_dir: {path} is not a registrations file ({exc}); move it away to start "
                         "without its registrations") from None
    return {e.instance_id: e for e in engines}


def _write_state(path: Path, engines: dict[int, Engine]) -> None:
    """Replace the state file atomically; ConnectionError (the store is unavailable) when it cannot."""
    data = {"version": 1, "engines": [json.loads(engines[i].encode()) for i in sorted(engines)]}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(json.dumps(data, indent=1, sort_keys=True).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ConnectionError(f"cannot write {path}: {exc.strerror or exc}") from None


class SharedEngineStore:
    """Registrations in a shared index's engine records (its ``engine_store``: Redis, so every replica sees
    every registration), encoded here."""

    def __init__(self, records: EngineRecords) -> None:
        self._records = records
        self.kept = records.kept

    async def all(self) -> dict[int, Engine]:
        out: dict[int, Engine] = {}
        for iid, raw in (await self._records.all()).items():
            try:
                out[iid] = Engine.decode(raw)
            except (ValueError, KeyError, TypeError):
                log.warning("skipping an undecodable engine registration %r", iid)
        return out

    async def swap(self, instance_id: int, old: Engine | None, new: Engine | None) -> bool:
        return await self._records.swap(instance_id, old.encode() if old else "", new.encode() if new else "")

    async def claim(self, instance_id: int, replica: str, status: str, lease: float) -> bool:
        return await self._records.claim(instance_id, replica, status, lease)

    async def release(self, instance_id: int, replica: str) -> None:
        await self._records.release(instance_id, replica)

    async def owners(self) -> dict[int, tuple[str, str]]:
        return await self._records.owners()

    async def close(self) -> None:
        """Nothing to release: the records share the index's connection, which the index closes."""


def open_engine_store(index: Index, *, state_dir: str = "") -> EngineStore:
    """The store that goes with ``index``: its own engine records when it has them (Redis), else this
    process's memory (kept in ``state_dir`` when given). ValueError when ``state_dir`` cannot be used."""
    records = index.engine_store
    if records is not None:
        if state_dir:
            log.warning("state_dir %s is not used: the Redis index keeps registrations itself", state_dir)
        return SharedEngineStore(records)
    return MemoryEngineStore(state_dir or None)
