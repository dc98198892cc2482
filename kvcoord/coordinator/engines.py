"""Engines registered over HTTP (``POST /register``, Dynamo's indexer API): the coordinator relays them.

A stock vLLM fleet then needs no sidecar. Each registered *instance* (Dynamo's ``instance_id``) is one
kvcoord node, ``node_id = str(instance_id)``, with one listener (ZMQ endpoint, optional replay endpoint)
per DP rank. Relaying is the agent's job, done in-process by an :class:`EngineRunner` (the agent's relay,
feeding this coordinator's ingest session directly: :class:`kvcoord.coordinator.engine_feed.LocalFeed`), so a
registered engine gets exactly what an agent gives: gap replay, restart detection, a mirror of its blocks
and a snapshot whenever the index needs one (also after the coordinator itself restarts: the relay
replays the engine's buffer from 0).

Registrations live in an :class:`~kvcoord.coordinator.engine_store.EngineStore`: in-process for the
memory index, the Redis index's ``engine_store`` (one Redis hash) for the Redis index, so every replica
sees every registration. Exactly
one replica relays each instance: it holds the instance's owner record (renewed every
:data:`CLAIM_SECONDS`); when that replica
dies its key lapses after :data:`OWNER_LEASE_SECONDS` and the next replica to claim it takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvcoord.coordinator.registry import CHANGES
from kvcoord.engine.zmq_wire import check_endpoint
from kvcoord.hashing import SGLANG, HashProfile
from kvcoord.validate import check_model, shown, valid_url
from kvcoord.waits import wait_event

if TYPE_CHECKING:
    from kvcoord.coordinator.engine_store import EngineStore

log = logging.getLogger("kvcoord.coordinator.engines")

__all__ = ["DEFAULT_GROUP", "ENGINE_KINDS", "RELAY_STATES", "Engine", "EngineRunner", "Engines", "Listener",
           "RegistrationError", "RelayedNode", "overall", "partition_model"]

DEFAULT_GROUP = "default"
CLAIM_SECONDS = 1.0
"""How often each replica renews its instances and claims unowned ones."""
OWNER_LEASE_SECONDS = 3.0
"""How long an owner key outlives its replica: the longest a dead replica's engines go unrelayed."""

PENDING, CONNECTING, ACTIVE, UNREACHABLE, FAILED = "pending", "connecting", "active", "unreachable", "failed"
RELAY_STATES = (FAILED, UNREACHABLE, CONNECTING, PENDING, ACTIVE)
"""A registered engine's listener, as ``/workers`` and ``kvcoord_registered_engines{state}`` show it, worst
first (an instance is as its worst listener): its relay cannot run (or the index refused the node); no
events and no answer from the engine within the lease (the node is in no lookup answer); relaying for less
than a lease and no answer yet; no replica relays it yet; answered within the lease (events, a replay
probe, or with no replay socket its PUB connection)."""


VLLM = "vllm"
ENGINE_KINDS = (VLLM, SGLANG)
"""What ``/register``'s ``engine`` names: how the engine publishes its block hashes. ``sglang``'s are signed
int64s (relayed as the agent's ``--signed-hashes`` relays them); ``vllm``'s, uint64s."""


def engine_kind(profile: HashProfile) -> str:
    """The engine whose hashes a model's hash profile computes."""
    return SGLANG if profile.algo == SGLANG else VLLM


def overall(states: Iterable[str]) -> str:
    """An instance's status: its worst listener's (:data:`RELAY_STATES`)."""
    seen = set(states)
    return next((s for s in RELAY_STATES if s in seen), PENDING)


class RelayedNode(NamedTuple):
    """A registered engine this replica relays, as ``ListNodes`` shows it while it is in no lookup answer."""

    model: str
    dp_ranks: tuple[int, ...]
    status: str
    reason: str


def partition_model(model_name: str, routing_group: str) -> str:
    """The index's model key of a Dynamo partition ``(model_name, routing_group)``: the model name itself
    for the default group (so agents and registered engines of one model share it), else ``name@group``."""
    return model_name if routing_group == DEFAULT_GROUP else f"{model_name}@{routing_group}"


GRPC_SCHEME = "grpc://"
"""A listener's endpoint for an engine's gRPC stream (``/register``'s ``grpc_endpoint``): ``grpc://HOST:PORT``."""


@dataclass(frozen=True, slots=True)
class Listener:
    """One DP rank of a registered instance."""

    dp_rank: int
    endpoint: str
    """ZMQ PUB endpoint, or :data:`GRPC_SCHEME` and the engine's ``SubscribeKvEvents`` server."""
    replay_endpoint: str | None = None

    @property
    def grpc_endpoint(self) -> str | None:
        """``HOST:PORT`` of the engine's gRPC stream; None for a ZMQ listener."""
        return self.endpoint.removeprefix(GRPC_SCHEME) if self.endpoint.startswith(GRPC_SCHEME) else None


@dataclass(frozen=True, slots=True)
class Engine:
    """One registered instance: a kvcoord node relayed by the coordinator."""

    instance_id: int
    model_name: str
    routing_group: str
    block_size: int
    listeners: tuple[Listener, ...]
    """Sorted by rank, one per rank."""
    serving_url: str = ""
    metrics_url: str = ""
    """The engine's Prometheus page (vLLM's ``/metrics``): its load, scraped for lookups; "" none."""
    kind: str = VLLM
    """One of :data:`ENGINE_KINDS`."""
    pools: tuple[str, ...] = ()
    """Shared pools the engine loads blocks from (kvcoord.coordinator.pools), said in its feed's Hello."""
    pool_publisher: str = ""
    """Set: the engine is that pool's storage daemon, not routable (its feed's Hello says so)."""
    role: str = ""
    """Its P/D role (``prefill``, ``decode``, ``both``; "" none), said in its feed's Hello."""

    @property
    def node_id(self) -> str:
        return str(self.instance_id)

    @property
    def source(self) -> str:
        """How its events come (``/workers``' ``source``): ``grpc`` or ``zmq``."""
        return "grpc" if any(x.grpc_endpoint for x in self.listeners) else "zmq"

    @property
    def model(self) -> str:
        return partition_model(self.model_name, self.routing_group)

    def encode(self) -> str:
        listeners = [[x.dp_rank, x.endpoint, x.replay_endpoint] for x in self.listeners]
        d: dict[str, Any] = {"instance_id": self.instance_id, "model_name": self.model_name,
                             "routing_group": self.routing_group, "block_size": self.block_size,
                             "listeners": listeners, "serving_url": self.serving_url}
        if self.metrics_url:  # only when set: a registration stored before it existed encodes as it was
            d["metrics_url"] = self.metrics_url
        if self.kind != VLLM:
            d["engine"] = self.kind
        if self.pools:
            d["pools"] = list(self.pools)
        if self.pool_publisher:
            d["pool_publisher"] = self.pool_publisher
        if self.role:
            d["role"] = self.role
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @classmethod
    def decode(cls, raw: str | bytes) -> Engine:
        d: dict[str, Any] = json.loads(raw)
        listeners = tuple(Listener(int(r), str(e), None if p is None else str(p))
                          for r, e, p in d["listeners"])
        return cls(int(d["instance_id"]), str(d["model_name"]), str(d["routing_group"]), int(d["block_size"]),
                   listeners, str(d.get("serving_url", "")), str(d.get("metrics_url", "")),
                   str(d.get("engine", VLLM)), tuple(str(p) for p in d.get("pools", ())),
                   str(d.get("pool_publisher", "")), str(d.get("role", "")))


class RegistrationError(Exception):
    """A refused (un)registration: ``status`` is the HTTP status Dynamo's indexer answers, ``message``
    its error text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class EngineRunner(Protocol):
    """Relays engines in this process (:class:`kvcoord.coordinator.engine_relays.Fleet`)."""

    async def start(self, engine: Engine) -> None:
        """Relay ``engine`` (restarting it if it already runs under another definition)."""
        ...

    async def stop(self, instance_id: int) -> None: ...

    def status(self, instance_id: int) -> dict[int, tuple[str, str]]:
        """``{dp_rank: (status, last_error)}``: :data:`RELAY_STATES` but ``pending``."""
        ...

    async def close(self) -> None: ...


def _u32(value: int | None, default: int = 0) -> int:
    return default if value is None else value


class Engines:
    """Registrations by Dynamo's rules, and this replica's share of the relaying."""

    def __init__(self, store: EngineStore, runner: EngineRunner, replica_id: str,
                 profile_of: Callable[[str], HashProfile | None],
                 on_removed: Callable[[str], None], max_engines: int = 1 << 62,
                 on_states: Callable[[dict[str, int]], None] | None = None) -> None:
        self.store = store
        self._on_states = on_states
        """Told after each sync how many instances this replica relays are in each of :data:`RELAY_STATES`."""
        self.max_engines = max_engines
        """Registered engines at most, over all replicas (``max_streams``: each is one relay's ingest
        feed on some replica). Checked before the store's swap, not in it: concurrent registrations of
        new instances may pass it together."""
        self.runner = runner
        self.replica_id = replica_id
        self._profile_of = profile_of
        """A model's configured hash profile (its block size, its engine), None when it has none."""
        self._on_removed = on_removed
        """Drops an unregistered instance's node (registry, shared record, index entries)."""
        self._running: dict[int, Engine] = {}
        self._known: dict[int, Engine] = {}
        self._failed: dict[int, tuple[Engine, str]] = {}
        """Registrations whose relay could not start here, with why (retried when they change)."""
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # --- the API's operations --------------------------------------------------------------
    async def register(self, instance_id: int, model_name: str, routing_group: str, block_size: int,
                       dp_rank: int | None, endpoint: str | None, replay_endpoint: str | None,
                       serving_url: str = "", metrics_url: str = "", engine: str | None = None,
                       grpc_endpoint: str = "", pools: Sequence[str] = (), pool_publisher: str = "",
                       role: str = "") -> None:
        """Add one listener, or raise :class:`RegistrationError` with Dynamo's status and message.
        ``engine`` (:data:`ENGINE_KINDS`; None: as the model's profile or its other registrations say, else
        vLLM) says how to decode its ZMQ events. ``grpc_endpoint`` (``HOST:PORT``) instead of ``endpoint``:
        the engine's ``SubscribeKvEvents`` stream, whose batches carry its load."""
        endpoint = self._event_source(endpoint, replay_endpoint, grpc_endpoint)
        if engine is not None and engine not in ENGINE_KINDS:
            raise RegistrationError(400, f"invalid engine {shown(engine, 64)}: expected one of "
                                         f"{', '.join(ENGINE_KINDS)}")
        urls = {"serving_url": (serving_url, ""), "metrics_url": (metrics_url, "/metrics")}
        for what, (url, path) in urls.items():
            try:
                urls[what] = (valid_url(url) if url else "", path)
            except ValueError:
                raise RegistrationError(400, f"invalid {what} {shown(url, 256)}: expected "
                                             f"http(s)://HOST[:PORT]{path}") from None
        serving_url, metrics_url = urls["serving_url"][0], urls["metrics_url"][0]
        for what, value in (("", endpoint), ("replay ", replay_endpoint)):
            if value is None or value.startswith(GRPC_SCHEME):
                continue
            try:
                check_endpoint(value, connect=True)
            except ValueError as exc:
                shown_value = shown(value, 256, quote=False)
                raise RegistrationError(400, f"invalid {what}endpoint `{shown_value}`: {exc}"
                                        if what else str(exc)) from None
        for what, name in (("model_name", model_name), ("routing_group", routing_group)):
            # The partition becomes the index's model name ("name@group"): a confusable one is refused.
            # An empty one is registered, as Dynamo does, and its relay shows failed (see /workers).
            try:
                if name:
                    check_model(name, what)
            except ValueError as exc:
                raise RegistrationError(400, str(exc)) from None
        rank = _u32(dp_rank)
        listener = Listener(rank, endpoint, replay_endpoint)
        model = partition_model(model_name, routing_group)
        for _ in range(8):
            engines = await self.store.all()
            old = engines.get(instance_id)
            # Dynamo's order: the instance's own conflicts, then the partition's block size.
            if old is not None and old.model != model:
                raise RegistrationError(409, f"instance {instance_id} is already registered for "
                                             f"model={old.model_name} routing_group={old.routing_group}")
            if old is not None and any(x.dp_rank == rank for x in old.listeners):
                raise RegistrationError(409, f"instance {instance_id} dp_rank {rank} already registered")
            kind = self._check_partition(engines, model, model_name, routing_group, block_size, engine)
            if old is None and len(engines) >= self.max_engines:
                raise RegistrationError(429, f"too many registered engines: max_streams is "
                                             f"{self.max_engines}; unregister one first")
            if old is None:
                new = Engine(instance_id, model_name, routing_group, block_size, (listener,), serving_url,
                             metrics_url, kind, tuple(pools), pool_publisher, role)
            else:
                listeners = tuple(sorted((*old.listeners, listener), key=lambda x: x.dp_rank))
                new = replace(old, listeners=listeners, serving_url=serving_url or old.serving_url,
                              metrics_url=metrics_url or old.metrics_url, pools=tuple(pools) or old.pools,
                              pool_publisher=pool_publisher or old.pool_publisher, role=role or old.role)
            if await self.store.swap(instance_id, old, new):
                log.info("engine %d (%s) dp_rank %d registered: %s", instance_id, model, rank,
                         shown(endpoint))
                with contextlib.suppress(ConnectionError):  # registered; the loop retries the claim
                    await self.sync()  # relaying (here, or by whichever replica claims it) before the answer
                return
        raise RegistrationError(409, f"instance {instance_id}: concurrent registrations; retry")

    @staticmethod
    def _event_source(endpoint: str | None, replay_endpoint: str | None, grpc_endpoint: str) -> str:
        """The listener's endpoint: the ZMQ one, or the gRPC one under :data:`GRPC_SCHEME` (one of them)."""
        if not grpc_endpoint:
            if endpoint is None:
                raise RegistrationError(422, "Failed to deserialize the JSON body into the target type: "
                                             "Object missing required field `endpoint`")
            return endpoint
        from kvcoord.engine.grpc_relay import check_grpc_endpoint

        if endpoint is not None or replay_endpoint is not None:
            raise RegistrationError(400, "grpc_endpoint is the engine's whole event stream: give it without "
                                         "endpoint and replay_endpoint")
        try:
            return GRPC_SCHEME + check_grpc_endpoint(grpc_endpoint)
        except ValueError as exc:
            raise RegistrationError(400, str(exc)) from None

    def _check_partition(self, engines: dict[int, Engine], model: str, model_name: str, routing_group: str,
                         block_size: int, engine: str | None) -> str:
        """The partition's block size and engine must be those of its profile, else of its registrations
        (409 otherwise); returns the engine kind to relay with."""
        profile = self._profile_of(model)
        peer = next((e for e in engines.values() if e.model == model), None)
        existing = profile.block_size if profile is not None else None
        if existing is None and peer is not None:
            existing = peer.block_size
        if existing is not None and existing != block_size:
            raise RegistrationError(409, f"block_size mismatch for model={model_name} routing_group="
                                         f"{routing_group}: existing={existing}, requested={block_size}")
        known = engine_kind(profile) if profile is not None else peer.kind if peer is not None else None
        if known is not None and engine is not None and known != engine:
            source = f"its hash profile is algo={profile.algo}" if profile is not None else "registered"
            raise RegistrationError(409, f"engine mismatch for model={model_name} routing_group="
                                         f"{routing_group}: existing={known} ({source}), requested={engine}")
        return engine or known or VLLM

    async def unregister(self, instance_id: int, model_name: str, routing_group: str | None,
                         dp_rank: int | None) -> None:
        """Remove a listener or a whole instance (Dynamo's dispatch), or raise :class:`RegistrationError`."""
        for _ in range(8):
            engines = await self.store.all()
            old = engines.get(instance_id)
            if old is None:
                raise RegistrationError(404, f"instance {instance_id} not found")
            other_group = routing_group is not None and old.routing_group != routing_group
            if old.model_name != model_name or other_group:
                raise RegistrationError(404, f"instance {instance_id} is registered for "
                                             f"model={old.model_name} routing_group={old.routing_group}")
            new: Engine | None = None
            if routing_group is not None and dp_rank is not None:
                if all(x.dp_rank != dp_rank for x in old.listeners):
                    raise RegistrationError(404, f"instance {instance_id} dp_rank {dp_rank} not found")
                left = tuple(x for x in old.listeners if x.dp_rank != dp_rank)
                new = replace(old, listeners=left) if left else None
            if await self.store.swap(instance_id, old, new):
                log.info("engine %d (%s) unregistered%s", instance_id, old.model,
                         f" dp_rank {dp_rank}" if new is not None else "")
                with contextlib.suppress(ConnectionError):
                    await self.sync()
                return
        raise RegistrationError(409, f"instance {instance_id}: concurrent registrations; retry")

    async def workers(self) -> list[tuple[Engine, dict[int, tuple[str, str]], str]]:
        """Every registration, its listeners' status as its relaying replica reports it, and that
        replica's id ("" while none relays it)."""
        engines = await self.store.all()
        owners = await self.store.owners()
        out = []
        for iid in sorted(engines):
            engine = engines[iid]
            status: dict[int, tuple[str, str]] = {x.dp_rank: (PENDING, "") for x in engine.listeners}
            owner = owners.get(iid)
            if iid in self._running or iid in self._failed:  # relayed here: the live status
                status.update((r, v) for r, v in self._status(iid).items() if r in status)
            elif owner is not None:
                try:
                    for rank, (st, err) in json.loads(owner[1]).items():
                        if int(rank) in status:
                            status[int(rank)] = (str(st), str(err))
                except (ValueError, TypeError, AttributeError):
                    pass
            relayed_by = self.replica_id if iid in self._running else owner[0] if owner is not None else ""
            out.append((engine, status, relayed_by))
        return out

    def _status(self, iid: int) -> dict[int, tuple[str, str]]:
        failed = self._failed.get(iid)
        if failed is not None:
            return {x.dp_rank: (FAILED, failed[1]) for x in failed[0].listeners}
        return self.runner.status(iid)

    def relayed_nodes(self) -> dict[str, RelayedNode]:
        """The instances relayed here, by node id, with their status and why (``ListNodes`` shows those
        that have no node record, or one in no answer)."""
        out = {}
        for iid, engine in [*self._running.items(), *((i, e) for i, (e, _) in self._failed.items())]:
            status = self._status(iid)
            state = overall(st for st, _ in status.values())
            reason = next((err for st, err in status.values() if st == state and err), "")
            out[engine.node_id] = RelayedNode(engine.model, tuple(x.dp_rank for x in engine.listeners), state,
                                              reason)
        return out

    def _count_states(self) -> None:
        if self._on_states is None:
            return
        counts = dict.fromkeys(RELAY_STATES, 0)
        for node in self.relayed_nodes().values():
            counts[node.status] += 1
        self._on_states(counts)

    def block_size(self, model: str) -> int | None:
        """The block size registrations of ``model`` declared (as of the last sync)."""
        return next((e.block_size for e in self._known.values() if e.model == model), None)

    def partitions(self) -> dict[str, int]:
        """Every registered partition and its block size (the first registration's, as :meth:`block_size`)."""
        out: dict[str, int] = {}
        for e in self._known.values():
            out.setdefault(e.model, e.block_size)
        return out

    def has_model(self, model: str) -> bool:
        return any(e.model == model for e in self._known.values())

    # --- relaying ----------------------------------------------------------------------------
    async def sync(self) -> None:
        """Claim or renew this replica's instances; start, restart or stop their relays to match."""
        async with self._lock:
            engines = await self.store.all()
            if engines != self._known:
                CHANGES.bump()  # block sizes and known models feed the HTTP API's native answers
            self._known = engines
            for iid in [i for i, (e, _) in self._failed.items() if engines.get(i) != e]:
                del self._failed[iid]  # changed: try again
                if iid not in engines:
                    await self.store.release(iid, self.replica_id)
            for iid, engine in engines.items():
                status = json.dumps({str(r): list(v) for r, v in self._status(iid).items()})
                if await self.store.claim(iid, self.replica_id, status, OWNER_LEASE_SECONDS):
                    cur = self._running.get(iid)
                    if cur != engine and iid not in self._failed:
                        if cur is not None:
                            await self.runner.stop(iid)
                            del self._running[iid]
                            if {x.dp_rank for x in cur.listeners} - {x.dp_rank for x in engine.listeners}:
                                self._on_removed(engine.node_id)  # a rank went: its entries go too
                        try:
                            await self.runner.start(engine)
                        except Exception as exc:  # this engine's problem: the others are still relayed
                            why = f"{type(exc).__name__}: {exc}"
                            log.error("engine %d (%s): cannot relay it: %s", iid, engine.model, why)
                            self._failed[iid] = (engine, why)
                            continue
                        self._running[iid] = engine
                elif iid in self._running:
                    log.warning("engine %d: another replica relays it now; stopping here", iid)
                    await self.runner.stop(iid)
                    del self._running[iid]
                else:
                    self._failed.pop(iid, None)  # another replica's now
            for iid in [i for i in self._running if i not in engines]:
                engine = self._running.pop(iid)
                await self.runner.stop(iid)
                await self.store.release(iid, self.replica_id)
                self._on_removed(engine.node_id)
            self._count_states()

    async def _loop(self) -> None:
        failing = ""
        started = False
        while True:
            try:
                await self.sync()
                if not started:
                    started = True
                    log.info("engine registrations: %d at start, %s", len(self._known), self.store.kept)
                if failing:
                    log.warning("engine registrations: reachable again")
                failing = ""
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                if why != failing:  # once per distinct failure, not every second
                    log.warning("engine registrations: %s (retrying every %.0f s)", why, CLAIM_SECONDS)
                failing = why
            self._wake.clear()
            # Jittered, so replicas that start together do not claim in lockstep.
            await wait_event(self._wake, CLAIM_SECONDS * random.uniform(0.8, 1.0))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvcoord-engines")

    async def close(self) -> None:
        """Stop relaying and hand this replica's instances over at once (their owner keys go)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.runner.close()
        for iid in list(self._running):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(0.5):
                    await self.store.release(iid, self.replica_id)
        self._running.clear()
        await self.store.close()
