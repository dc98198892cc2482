from collections.abc import Callable

def cbor_chain(
    hash_fn: Callable[[bytes], object],
    call_digest: bool,
    parent: bytes,
    tokens: object,
    block_size: int,
    count: int,
    tails: bytes | list[bytes],
    /,
) -> list[bytes]: ...

def pickle_chain(
    hash_fn: Callable[[bytes], object],
    call_digest: bool,
    parent: bytes,
    tokens: object,
    block_size: int,
    count: int,
    /,
) -> list[bytes]: ...
