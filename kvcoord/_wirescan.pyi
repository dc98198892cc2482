from collections.abc import Sequence
from typing import Any, TypeVar

_Row = TypeVar("_Row", bound=tuple[Any, ...])

STORE: int
REMOVE: int
CLEAR: int

def scan(
    data: bytes, /
) -> (
    list[
        tuple[
            int,  # seq
            float,  # ts
            int,  # dp_rank
            bool,  # dp_rank_absent
            int,  # n_events
            int,  # n_stored
            int,  # n_removed
            int,  # n_cleared
            list[tuple[int, Sequence[object], str | None, int | None, str | None]],  # raw events
            list[tuple[int, int, int, int | bytes | None, str | None]],  # per BlockStored
            int,  # start of the EventBatch in data
            int,  # its end
        ]
    ]
    | None
): ...

def pack_uint64(seq: object, /) -> bytes | None: ...
def mirror_walk(
    copy: dict[int, bytes],
    hashes: Sequence[int],
    live: dict[int, tuple[str, str, int]],
    allowed: set[int] | None,
    cls: type[_Row],
    /,
) -> list[_Row] | None: ...
