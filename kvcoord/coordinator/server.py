"""Run the coordinator: in-process (:class:`CoordinatorServer`) or as ``kvcoord serve``.

The index object is passed in (or opened from ``config.index`` at start), never chosen at import.
Stopping is bounded: gRPC gets a short grace period, background tasks are cancelled, the metrics
HTTP server is shut down and (when the server opened it) the index is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from types import TracebackType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvcoord.coordinator.auth import Authenticator
from kvcoord.coordinator.config import CoordinatorConfig
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.engine_relays import Fleet
from kvcoord.coordinator.engine_store import open_engine_store
from kvcoord.coordinator.engines import Engines
from kvcoord.coordinator.fastpath import FastAnswers
from kvcoord.coordinator.httpapi import HttpApi
from kvcoord.coordinator.httpd import HttpLimits, HttpServer
from kvcoord.coordinator.metrics import Metrics
from kvcoord.coordinator.reclaim import limit_arenas
from kvcoord.coordinator.servicer import SERVICE, CoordinatorServicer
from kvcoord.coordinator.shared import open_directory
from kvcoord.coordinator.tls import server_credentials, server_ssl_context
from kvcoord.coordinator.workers import FeedIndex, LookupWorkers, reserve_port
from kvcoord.eventloop import loop_name
from kvcoord.index import open_index
from kvcoord.index.base import Index, ping
from kvcoord.index.uri import parse_index_uri
from kvcoord.media import configure_media
from kvcoord.native import native_paths
from kvcoord.transport import ListenError, check_bindable, split_hostport

log = logging.getLogger("kvcoord.coordinator")

LIVENESS = "kvcoord.liveness"
"""Health service name that is SERVING while the process runs, whatever the index does: the liveness
probe's. ``""`` and ``kvcoord.v2.Coordinator`` follow the index (readiness): a Redis outage must take
a replica out of rotation, not get it restarted."""


class CoordinatorServer:
    """One coordinator instance: ``await start()``, use ``port``/``metrics_port``, ``await stop()``."""

    def __init__(
        self, config: CoordinatorConfig, index: Index | None = None, *, close_index: bool | None = None,
        relay_engines: bool = False,
    ) -> None:
        self.config = config
        self._relay_engines = relay_engines
        """Relay engines registered over HTTP in this process (a
        :class:`~kvcoord.coordinator.engine_relays.Fleet`, as ``kvcoord serve`` does); False: ``/register``
        answers 501."""
        self.engines: Engines | None = None
        self._http: HttpServer | None = None
        self.http_port: int | None = None
        self._index = index
        self._close_index = close_index if close_index is not None else index is None
        self.state: CoordinatorState | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._servicer: CoordinatorServicer | None = None
        self._stopped = asyncio.Event()
        self.workers: LookupWorkers | None = None
        """``lookup_workers`` processes answering the HTTP lookups (:mod:`kvcoord.coordinator.workers`)."""
        self.main_http_port: int | None = None
        """With workers: this process's own HTTP listener (loopback), where they forward other routes."""
        self._held_port: socket.socket | None = None

    @property
    def address(self) -> str:
        host, _ = split_hostport(self.config.listen)
        host = "127.0.0.1" if host in ("", "0.0.0.0") else host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def start(self) -> None:
        cfg = self.config
        configure_media(cfg.media)  # this process's decoders (the relays of /register'ed engines) map so
        spec = parse_index_uri(cfg.index, key_prefix=cfg.index_key_prefix)  # checked when cfg was read
        if self._index is None and cfg.lookup_workers:
            self._index = FeedIndex()  # config checked: memory
        index = self._index if self._index is not None else open_index(spec)
        if cfg.lookup_workers and not isinstance(index, FeedIndex):
            raise ListenError("lookup_workers needs the coordinator's own memory index")
        self._index = index
        directory = open_directory(index)
        metrics = Metrics()
        state = self.state = CoordinatorState(cfg, metrics.instrument(index), metrics, directory=directory)
        state.metrics.model_seen(*cfg.models)
        auth = Authenticator(cfg.auth)
        for address in (cfg.listen, cfg.metrics_listen, cfg.http_listen):
            if address:
                check_bindable(address)
        await self._start_grpc(state, auth)
        up = False
        with contextlib.suppress(Exception):
            up = bool(await asyncio.wait_for(ping(index), timeout=2.0))
        state.health.up = up
        state.metrics.index_up.labels(index.backend).set(1 if up else 0)
        assert state.health.on_health is not None
        await state.health.on_health(up)
        if not up:
            log.warning("index backend %s does not answer; serving NOT_SERVING until it does", index.backend)
        await state.refresh()
        if cfg.metrics_listen:
            host, port = split_hostport(cfg.metrics_listen)
            try:
                self.metrics_port = state.metrics.endpoint.serve(host, port)
            except OSError as exc:
                await self.stop()
                raise ListenError(f"cannot listen on {cfg.metrics_listen}: {exc.strerror or exc}") from None
        if self._relay_engines:
            # The store first: a state_dir that cannot be used refuses the start before any relay exists.
            store = open_engine_store(index, state_dir=cfg.state_dir)
            self.engines = Engines(store, Fleet(state), state.replicas.replica_id, self.config.profile,
                                   state.leases.drop, max_engines=cfg.limits.max_streams,
                                   on_states=state.metrics.set_registered_engines)
            state.relayed_nodes = self.engines.relayed_nodes
        if cfg.http_listen:
            await self._start_http(state, auth)
        state.start_background()
        if self.engines is not None:
            self.engines.start()

    async def _start_grpc(self, state: CoordinatorState, auth: Authenticator) -> None:
        cfg = self.config
        opts = [
            ("grpc.max_receive_message_length", cfg.limits.max_message_bytes),
            ("grpc.max_send_message_length", max(cfg.limits.max_message_bytes, 4 * 1024 * 1024)),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # No BDP probing: it grows each stream's receive window to megabytes, which gRPC fills with
            # the messages of streams that are about to be refused (8 flooding snapshot streams: +25 MB
            # of RSS). A pending read still opens the window to its message's size.
            ("grpc.http2.bdp_probe", 0),
        ]
        server = grpc.aio.server(options=opts)
        servicer = self._servicer = CoordinatorServicer(state, auth)
        server.add_generic_rpc_handlers((servicer.generic_handler(),))
        hs = self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        await hs.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        try:
            if cfg.tls.enabled:
                self.port = server.add_secure_port(cfg.listen, server_credentials(cfg.tls))
            else:
                self.port = server.add_insecure_port(cfg.listen)
        except RuntimeError as exc:
            raise ListenError(f"cannot listen on {cfg.listen}: {exc}") from None
        if not self.port:
            raise ListenError(f"cannot listen on {cfg.listen}")
        await server.start()
        self._server = server

        async def on_health(up: bool) -> None:
            status = (
                health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await hs.set("", status)
            await hs.set(SERVICE, status)

        state.health.on_health = on_health

    async def _start_http(self, state: CoordinatorState, auth: Authenticator) -> None:
        cfg = self.config
        api = HttpApi(state, self.engines, auth)
        lim = cfg.limits
        limits = HttpLimits(lim.http_header_timeout_s, lim.http_max_header_bytes, lim.http_max_connections,
                            lim.http_idle_timeout_s)
        replica = [("x-kvcoord-replica", state.replicas.replica_id)]
        http = self._http = HttpServer(api.routes(), api.authorize, replica,
                                       limits=limits, on_refused=state.metrics.http_refused)
        if FastAnswers.available(api):
            api.fast = FastAnswers(api)
        host, port = split_hostport(cfg.http_listen)
        try:
            if cfg.lookup_workers:  # the port is the workers'; this process answers them on loopback
                self._held_port = reserve_port(host, port)
                self.http_port = int(self._held_port.getsockname()[1])
                self.main_http_port = await http.start("127.0.0.1", 0)
            else:
                ssl_context = server_ssl_context(cfg.tls) if cfg.tls.enabled else None
                self.http_port = await http.start(host, port, ssl_context)
        except OSError as exc:
            await self.stop()
            raise ListenError(f"cannot listen on {cfg.http_listen}: {exc.strerror or exc}") from None
        if cfg.lookup_workers and self.main_http_port is not None:
            assert isinstance(self._index, FeedIndex)
            self.workers = LookupWorkers(state, self._index, self.engines, cfg.lookup_workers, host,
                                         self.http_port, self.main_http_port)
            await self.workers.start()

    async def stop(self, grace: float = 0.5) -> None:
        """Stop serving within ``grace`` plus a little.

        Ingest streams never end on their own, so waiting out the grace for them would only delay
        the agents' failover: they are ended at once with UNAVAILABLE and a message saying why
        (a stream opened from here on is refused the same way). Unary calls get the grace period.
        """
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._health is not None:
            with contextlib.suppress(Exception):
                await self._health.enter_graceful_shutdown()
        if self.workers is not None:
            await self.workers.stop()
        if self._held_port is not None:
            self._held_port.close()
        if self._http is not None:
            await self._http.stop(grace=min(grace, 0.5))
        if self.engines is not None:
            await self.engines.close()  # its relays' streams end before the server's are cut
        if self._servicer is not None:
            await self._servicer.shutdown_streams(timeout=max(grace, 0.2))
        if self._server is not None:
            await self._server.stop(grace)
        if self.state is not None:
            await self.state.stop_background()
            self.state.metrics.endpoint.close()
        if self._close_index and self._index is not None:
            try:
                await asyncio.wait_for(self._index.close(), timeout=1.0)
            except Exception:
                log.warning("closing the index did not finish cleanly", exc_info=True)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def __aenter__(self) -> CoordinatorServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def serve(config: CoordinatorConfig, *, relay_engines: bool = False) -> None:
    """Run until SIGTERM or SIGINT, then stop within about a second."""
    limit_arenas()  # before gRPC starts its threads
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before listening, so an early signal still stops cleanly
        loop.add_signal_handler(sig, stop.set)
    server = CoordinatorServer(config, relay_engines=relay_engines)
    try:
        await server.start()
    except BaseException:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await server.stop(grace=0)
        raise
    assert server.state is not None
    metrics = (
        f"http://{split_hostport(config.metrics_listen)[0]}:{server.metrics_port}/metrics"
        if server.metrics_port
        else "off"
    )
    security = "mTLS" if config.tls.client_ca else "TLS" if config.tls.enabled else "plaintext"
    if config.auth.enabled:
        security += ", token auth"
    http = "http off"
    if server.http_port:
        http = f"http {split_hostport(config.http_listen)[0]}:{server.http_port}"
        if server.workers is not None:
            http += (f" ({config.lookup_workers} lookup workers, pids "
                     f"{','.join(map(str, server.workers.pids()))}; main 127.0.0.1:{server.main_http_port})")
    print(
        f"kvcoord serve: grpc {server.address} ({security}), {http}, metrics {metrics}, "
        f"index {server.state.index.backend}, models: {', '.join(sorted(config.models)) or 'any'}, "
        f"native: {','.join(native_paths()) or 'none (pure Python)'}, event loop: {loop_name()}",
        file=sys.stderr,
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        print("kvcoord serve: stopping", file=sys.stderr, flush=True)
        await server.stop(grace=0.5)
    print("kvcoord serve: stopped", file=sys.stderr, flush=True)
