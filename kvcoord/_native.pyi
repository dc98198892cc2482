"""kvcoord's native hot paths (sources: kvcoord/_native/). Use them through ``kvcoord.native.native``."""

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

_Row = TypeVar("_Row", bound=tuple[Any, ...])

# --- hash chains (hashchain.c; Python twin: kvcoord.hashing._chain_reference) ---------------------
C_DIGESTS: dict[str, int]
"""Digests this build computes in C, by name (``sha256`` needs OpenSSL at build time; ``xxh3_128``)."""

def cbor_chain(
    hasher: Callable[[bytes], object] | int,
    call_digest: bool,
    parent: bytes,
    tokens: object,
    block_size: int,
    count: int,
    tails: bytes | list[bytes],
    keys_only: bool = False,
    /,
) -> list[bytes] | bytes: ...
def pickle_chain(
    hasher: Callable[[bytes], object] | int,
    call_digest: bool,
    parent: bytes,
    tokens: object,
    block_size: int,
    count: int,
    keys_only: bool = False,
    /,
) -> list[bytes] | bytes: ...
def sglang_chain(
    parent: bytes,
    tokens: object,
    block_size: int,
    count: int,
    namespace: bytes,
    keys_only: bool = False,
    /,
) -> list[bytes] | bytes:
    """SGLang's page-hash chain (only in builds with OpenSSL: ``"sha256" in C_DIGESTS``; Python twin:
    ``kvcoord.hashing._sglang_chain_reference``)."""

# --- JSON integer arrays (jsonints.c; twin: msgspec's typed decode in kvcoord.coordinator.httpapi) ---
def json_take_ints(data: bytes | memoryview, key: str, kind: str, /) -> tuple[bytes | None, bytes] | None: ...

# --- the memory index's table (table.c; Python twin: kvcoord.index.memory._Model) ------------------
class Table:
    """One model's block table: uint64 key -> holders (slot, tier mask)."""

    def __init__(self) -> None: ...
    def __len__(self) -> int: ...
    def store(self, slot: int, tier: int, hashes: Sequence[int], /) -> int: ...
    def remove(self, slot: int, tier: int, hashes: Sequence[int], /) -> int: ...
    def set_live(self, slot: int, live: bool, /) -> None: ...
    def set_order(self, slots: list[int] | tuple[int, ...], /) -> None: ...
    def match(
        self,
        hashes: Sequence[int],
        candidates: list[int] | None,
        keys: list[tuple[str, int] | None],
        cls: type[tuple[str, int, int, tuple[int, ...]]] | None,
        /,
    ) -> list[tuple[str, int, int, tuple[int, ...]]]: ...
    def columns(self, slot: int, /) -> tuple[list[int], list[int], list[int]]: ...
    def rows(self, keys: bytes | memoryview, /) -> bytes: ...
    def export(self, slot: int, /) -> list[tuple[int, int]]: ...
    def sweep_begin(self, slots: list[int] | tuple[int, ...], /) -> None: ...
    def sweep_step(self, budget: int, /) -> tuple[int, bool]: ...
    def nbytes(self) -> int: ...
    def layout(self) -> int: ...

def validate_u64_seq(seq: object, /) -> bool: ...
def store_fits(ev: object, /) -> bool: ...
def u64_view(seq: object, /) -> Sequence[int] | None: ...

# --- the Redis mirror's holder walk (walk.c; Python twin: kvcoord.index.redis.walk._walk_runs) -----
def mirror_walk(
    copy: dict[int, bytes],
    hashes: Sequence[int],
    live: dict[int, tuple[str, str, int]],
    allowed: set[int] | None,
    cls: type[_Row],
    /,
) -> list[_Row] | None: ...

# --- histogram counts (tally.c; twin: kvcoord.coordinator.metrics.PyTally) ----------------------
class Tally:
    """A histogram's counts as plain numbers (tally.c; twin: kvcoord.coordinator.metrics.PyTally)."""

    def __init__(self, bounds: tuple[float, ...], /) -> None: ...
    def observe(self, value: float, /) -> None: ...
    def counts(self) -> tuple[tuple[int, ...], float]: ...
