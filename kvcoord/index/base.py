"""The index protocol every backend implements, and the value types it speaks.

Semantics (DESIGN.md): keys are ``(model, uint64 block hash)``; locations are
``(node_id, dp_rank, tier)``; a match is, per ``(node_id, dp_rank)``, the longest gap-free
leading run of the query that the node holds on any tier, with per-tier counts. Events are
idempotent. A batch reaches an index as validated :class:`~kvcoord.validate.Op` s, so a bad event
was refused whole before anything was applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcoord._native import Table

from collections.abc import Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar, runtime_checkable

from kvcoord.events import Tier
from kvcoord.hashing import BlockHash64
from kvcoord.validate import Op, SnapshotEntry

__all__ = [
    "ApplyResult",
    "EngineRecords",
    "FencedWrite",
    "Fencing",
    "Index",
    "IndexReset",
    "IndexStats",
    "NativeView",
    "NodeKey",
    "NodeMatch",
    "NodeRecords",
    "Remote",
    "ReservationFeed",
    "WriteNotReplicated",
    "fence_token",
    "ping",
    "run_inline",
]

NodeKey: TypeAlias = tuple[str, int]
"""``(node_id, dp_rank)``: the unit a match is reported for."""


class NodeMatch(NamedTuple):
    """How much of a query one ``(node_id, dp_rank)`` holds.

    A NamedTuple (immutable, compares equal to the plain 4-tuple) because matches return one per
    node and a frozen dataclass cost ~1 us each to build; the memory index's C core builds these
    directly.
    """

    node_id: str
    dp_rank: int
    matched_blocks: int
    tiers: tuple[int, ...]
    """Blocks of the matched run per tier, indexed by ``Tier`` value (GPU, CPU, STORAGE)."""


class FencedWrite(Exception):
    """A shared backend refused a write for ``node_id``: another process claimed the node after this one
    did (:meth:`Fencing.claim`), so this one is a stale owner (paused, partitioned) and must drop it.
    Nothing of the refused call was applied."""

    def __init__(self, node_id: str, message: str) -> None:
        super().__init__(message)
        self.node_id = node_id


class WriteNotReplicated(Exception):
    """A write was applied on the primary, but fewer replicas than the index's ``wait_replicas`` confirmed
    it within ``wait_timeout`` (Redis ``WAIT``): a failover now could lose it. The caller must not treat it
    as acknowledged; applying the same call again is idempotent, so it is retried."""


class IndexReset(Exception):
    """A shared backend lost its contents (flushed, restarted empty) since this process last read its
    generation (:meth:`Remote.generation`), and noticed it in the call itself: a lookup gave no answer,
    a write applied nothing. ``buckets``: the parts found changed. The caller re-reads the generation
    (which makes every node resync) before it reads or writes again: nothing is ever answered from, or
    written on top of, a keyspace that lost its data without the nodes resyncing first."""

    def __init__(self, buckets: list[str], message: str) -> None:
        super().__init__(message)
        self.buckets = buckets


@dataclass(slots=True)
class ApplyResult:
    """Block-level counts of what one ``apply`` did."""

    stored: int = 0
    removed: int = 0
    removed_unknown: int = 0
    cleared: int = 0
    skipped_group: int = 0

    def add(self, other: ApplyResult) -> None:
        self.stored += other.stored
        self.removed += other.removed
        self.removed_unknown += other.removed_unknown
        self.cleared += other.cleared
        self.skipped_group += other.skipped_group


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Size of the index. ``entries`` counts (block, location) pairs; ``blocks`` distinct keys."""

    entries: int
    blocks: int
    nodes: int
    bytes: int
    entries_by_model_tier: dict[tuple[str, Tier], int] = field(default_factory=dict)
    blocks_by_model: dict[str, int] = field(default_factory=dict)
    blocks_upper_bound: bool = False
    """``blocks``/``blocks_by_model`` are an upper bound, not exact (see :class:`QuickStats`)."""


class MirrorStatus(Protocol):
    """A backend's in-memory copy of a remote index, when it keeps one."""

    @property
    def ready(self) -> bool: ...
    def current(self) -> bool:
        """Lookups are answered from the copy now (loaded, and provably current)."""
        ...
    @property
    def loads(self) -> int: ...
    @property
    def entries_applied(self) -> int: ...
    @property
    def lookups(self) -> int: ...


class BackendMetrics(Protocol):
    """Counters a remote backend keeps of its own round trips; the coordinator exports them (the
    backend does not import Prometheus). ``latency_counts``: round trips per bucket bound,
    non-cumulative, with one more slot for +Inf."""

    @property
    def latency_buckets(self) -> tuple[float, ...]: ...
    @property
    def latency_counts(self) -> list[int]: ...
    @property
    def round_trip_seconds(self) -> float: ...
    @property
    def errors(self) -> int: ...
    @property
    def connection_errors(self) -> int: ...
    @property
    def readonly_errors(self) -> int: ...
    @property
    def failovers(self) -> int: ...
    @property
    def reconnects(self) -> int: ...
    @property
    def reclaimed_entries(self) -> int: ...
    @property
    def reclaimed_nodes(self) -> int: ...
    @property
    def walked_lookups(self) -> int: ...
    @property
    def mirror(self) -> MirrorStatus | None: ...
    @property
    def waits(self) -> int: ...
    @property
    def wait_short(self) -> int: ...
    @property
    def wait_seconds(self) -> float: ...


class Fencing(Protocol):
    """Who may write a node, when several processes share one index (Redis): the index's ``fencing``."""

    async def claim(self, node_id: str) -> None:
        """This process takes ``node_id`` over (a new ingest stream, not a resumed one). The backend
        gives the node a new fencing token, higher than any before, at this process's next write for it,
        and from then on refuses writes for the node (``apply``, ``replace_node``, ``clear``,
        ``remove_node``) from processes holding an older token: each raises :class:`FencedWrite`.
        A process that never claimed a node writes unfenced (library use, admin removal)."""
        ...

    def fence_token(self, node_id: str) -> int:
        """The fencing token this process holds for ``node_id`` (0: none)."""
        ...

    async def reclaim_node(self, node_id: str, token: int) -> bool:
        """Remove a dead owner's ``node_id`` (as ``remove_node``) only if its fencing token is still
        ``token`` (nobody claimed it since that owner did), and fence that token out. True if it removed
        something."""
        ...


class NativeView(Protocol):
    """The index's tables as C objects, for answers computed wholly in C: the index's ``native``."""

    def native_view(self, model: str) -> tuple[Table, list[NodeKey | None]] | None:
        """``model``'s native block table (a ``kvcoord._native.Table``, its tie-break order current) and
        its slot keys (``(node_id, dp_rank)`` per slot, None where free); None while the model has no
        table (then lookups go through :meth:`Index.match`). The view is read at once, on the event
        loop, and never kept past a change of ``Table.layout()``."""
        ...


class Remote(Protocol):
    """A backend outside this process (Redis): its health, its contents' lifetime and its own round-trip
    counters. The index's ``remote``; None for an in-process index, which is always up and whose
    contents live exactly as long as it does."""

    @property
    def metrics(self) -> BackendMetrics:
        """The backend's own round-trip counters (the coordinator exports them)."""
        ...

    async def ping(self) -> bool:
        """True when the backend can serve."""
        ...

    async def generation(self) -> str:
        """An opaque id of the current contents' lifetime. It changes only when everything stored
        before is gone (e.g. Redis restarted empty), and the coordinator then asks every agent for a
        snapshot. Reading it is also how the backend accepts the current lifetime: until then, its
        lookups and writes raise :class:`IndexReset` once the contents were lost. Cheap (called every
        stats interval and after every outage); raises ``ConnectionError`` when the backend is
        unreachable."""
        ...


class NodeRecords(Protocol):
    """Records coordinator replicas publish about the nodes whose streams they hold, kept beside a shared
    index: the index's ``node_directory``. A record is the coordinator's string, a JSON object with at
    least ``owner``, ``heard`` and ``fence``. Methods raise ``ConnectionError`` when the store is down."""

    async def publish(self, records: Sequence[tuple[str, str, float, int, str]]) -> None:
        """Write each ``(node_id, owner, heard, fence, record)``, atomically per call; a stored record of
        another owner that outranks it is kept (the higher fence when both have one, else the later
        heard)."""
        ...

    async def fetch_all(self) -> dict[str, bytes]: ...
    async def fetch(self, node_id: str) -> bytes | None: ...
    async def delete(self, node_ids: Sequence[str]) -> None: ...


class EngineRecords(Protocol):
    """Engines registered over HTTP and which replica relays each, kept beside a shared index: the
    index's ``engine_store``. Registrations are the coordinator's strings. Methods raise
    ``ConnectionError`` when the store is down."""

    kept: str
    """Where registrations are kept, in words (the start-up line)."""

    async def all(self) -> dict[int, bytes]: ...

    async def swap(self, instance_id: int, old: str, new: str) -> bool:
        """Replace the registration if it still is ``old`` ("": absent) by ``new`` ("": delete); False if
        it changed meanwhile."""
        ...

    async def claim(self, instance_id: int, replica: str, status: str, lease: float) -> bool:
        """Become (or stay) the instance's owner for ``lease`` seconds; False when another replica is."""
        ...

    async def release(self, instance_id: int, replica: str) -> None: ...

    async def owners(self) -> dict[int, tuple[str, str]]:
        """``{instance_id: (replica, status)}`` of the owner records alive now."""
        ...


class ReservationFeed(Protocol):
    """Where coordinator replicas sharing an index exchange their routers' reservation changes (opaque
    entries, the coordinator's bytes), kept beside the index: its ``reservation_feed``. Methods raise
    ``ConnectionError`` when the store is down."""

    async def append(self, entry: bytes) -> str:
        """Append ``entry`` alone (a stopping replica's last word); its position."""
        ...

    async def history(self, entry: bytes, seconds: float) -> tuple[str, float, list[tuple[float, bytes]]]:
        """Append ``entry``, then read back the entries of the last ``seconds`` up to it, oldest first
        (the store keeps a bounded number): ``(the position of ``entry``, when it was added, [(when
        added, entry)])``, times in seconds by the store's clock; this reader's own entries come back
        too. A reader starts here."""
        ...

    async def exchange(self, entry: bytes | None,
                       after: str) -> tuple[str, float | None, list[tuple[float, bytes]]]:
        """Append ``entry`` (if any), then read the entries after position ``after``, in one round trip:
        ``(the position after the last one read, when ``entry`` was added (None: no entry), [(when added,
        entry)])``, times as :meth:`history`'s; this reader's own entry comes back too."""
        ...

    async def claim(self, name: str, holder: bytes, seconds: float) -> tuple[bytes, float] | None:
        """Claim ``name`` for ``holder`` for ``seconds`` unless another holder has it, in one round trip:
        None when claimed, else whoever holds it and for how many seconds more (a lookup's hold on a new
        prefix, across replicas)."""
        ...


@runtime_checkable
class Index(Protocol):
    """A global block index: eight coroutines, so that remote backends fit the same shape, and the
    optional capabilities a backend has (each an object, or None where the backend has no such thing)."""

    backend: str
    """Short backend name for logs and metrics (``memory``, ``redis``, ``redis-cluster``)."""
    inline: bool
    """True when no method ever suspends (an in-process backend): code outside an event loop, such as the
    simulator, may run its coroutines to completion at once with :func:`run_inline`."""
    fencing: Fencing | None
    """Write fencing between processes sharing the index (Redis); None when single-process."""
    native: NativeView | None
    """C tables for native lookups (the memory index on its C core); None otherwise."""
    remote: Remote | None
    """Health, lifetime and round-trip counters of an out-of-process backend; None in-process."""
    node_directory: NodeRecords | None
    """Where replicas sharing the index publish their nodes; None when single-process."""
    engine_store: EngineRecords | None
    """Where registrations live when replicas share the index; None: the coordinator keeps its own."""
    reservation_feed: ReservationFeed | None
    """Where replicas sharing the index exchange routers' reservations; None when single-process."""

    async def apply(self, model: str, node_id: str, dp_rank: int, ops: Sequence[Op]) -> ApplyResult:
        """Apply one node's validated ops in order (:func:`kvcoord.validate.ops_of` of events, or
        :func:`kvcoord.wire.ops_from_proto` of the wire): the only way anything enters an index.
        Raises ``InvalidEvent`` (applying nothing) for a bad target."""
        ...

    async def match(
        self,
        model: str,
        hashes: Sequence[BlockHash64],
        candidates: Collection[NodeKey] | None = None,
    ) -> list[NodeMatch]:
        """Nodes holding a non-empty leading run of ``hashes``, longest first (ties by node id, rank)."""
        ...

    async def clear(self, model: str, node_id: str, dp_rank: int) -> None:
        """Drop every entry of ``(node_id, dp_rank)`` for ``model`` (AllBlocksCleared)."""
        ...

    async def remove_node(self, node_id: str) -> None:
        """Make ``node_id`` vanish from matches at once, for every model and rank.

        Its entries are reclaimed in the background or lazily; re-adding the id later starts empty.
        """
        ...

    async def export_node(self, model: str, node_id: str, dp_rank: int) -> list[SnapshotEntry]:
        """Every (block, tier) that ``(node_id, dp_rank)`` holds for ``model``, sorted."""
        ...

    async def replace_node(
        self, model: str, node_id: str, dp_rank: int, hashes: Sequence[BlockHash64], tiers: bytes = b""
    ) -> None:
        """Atomically for readers, make ``(node_id, dp_rank)`` hold exactly ``hashes`` for ``model``.

        ``tiers`` has one byte (a ``Tier`` value) per hash; empty: every block is on GPU. Columns, not
        pairs: a snapshot of millions of blocks stays two flat buffers from the wire to the index.
        Raises ``InvalidEvent`` (replacing nothing) for a bad hash or tier."""
        ...

    async def stats(self, *, exact: bool = True) -> IndexStats:
        """Counts of entries, blocks, nodes, and an estimate of bytes held. ``exact=False``: cheap
        enough to call every few seconds, ``blocks`` may be an upper bound (then ``blocks_upper_bound``
        is set), and retirements may not be reclaimed yet."""
        ...

    async def close(self) -> None:
        """Release connections and background tasks."""
        ...


def fence_token(index: Index, node_id: str) -> int:
    """The fencing token this process holds for ``node_id`` in ``index`` (0: none, or no fencing)."""
    fencing = index.fencing
    return 0 if fencing is None else fencing.fence_token(node_id)


async def ping(index: Index) -> bool:
    """Whether ``index`` can serve: its remote's ping; an in-process index always can."""
    remote = index.remote
    return True if remote is None else await remote.ping()


_T = TypeVar("_T")


def run_inline(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine of an ``inline`` index to completion now (it never suspends)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("an inline index suspended")
