"""Index URIs: ``memory``, ``redis://host:port/db?…``, ``rediss://…``, ``unix://…``,
``redis+cluster://h1:p1,h2:p2?…`` or ``redis+sentinel://h1:p1,h2:p2/master-name?…``, parsed and checked
in one place.

A URI is refused whole, at start-up, for any option it does not know: a typo such as ``?bucket=4``
must not become a server that connects with a default and stays NOT_SERVING.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

OPTIONS = ("buckets", "mirror", "prefix", "timeout", "wait_replicas", "wait_timeout")
"""kvcoord's own query options (the rest of the URI is the connection's)."""
REDIS_OPTIONS = ("client_name", "health_check_interval", "socket_keepalive", "ssl_ca_certs", "ssl_cert_reqs",
                 "ssl_certfile", "ssl_check_hostname", "ssl_keyfile")
"""redis-py connection options passed through (standalone Redis, Cluster and Sentinel)."""
CLUSTER_OPTIONS = ("ssl",)
"""Cluster only: TLS to every node (``ssl=1``; the ``ssl_*`` options need it)."""
SENTINEL_OPTIONS = ("sentinel_password", "sentinel_ssl", "sentinel_username", "ssl")
"""Sentinel only: the sentinels' own credentials, TLS to the sentinels (``sentinel_ssl=1``) and to the
data nodes (``ssl=1``); the ``ssl_*`` options apply to both. The data nodes' credentials are the URI's
userinfo, as for ``redis://``."""
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "redis+sentinel")


@dataclass(frozen=True, slots=True)
class RedisUri:
    """A Redis index URI, validated: where to connect and kvcoord's options."""

    url: str
    """The connection URL for redis-py (standalone), without kvcoord's options."""
    cluster_nodes: tuple[tuple[str, int], ...] = ()
    """Startup nodes of a Redis Cluster (``redis+cluster://``); empty for a standalone Redis."""
    sentinels: tuple[tuple[str, int], ...] = ()
    """The sentinels (``redis+sentinel://``) that name the current primary of ``service``."""
    service: str = ""
    """The master name the sentinels monitor (``redis+sentinel://…/<name>``)."""
    db: int = 0
    node_options: tuple[tuple[str, Any], ...] = ()
    """Cluster and Sentinel: redis-py keyword arguments of the data-node connections (typed, checked)."""
    sentinel_options: tuple[tuple[str, Any], ...] = ()
    """Sentinel: redis-py keyword arguments of the connections to the sentinels."""
    username: str | None = None
    password: str | None = None
    buckets: int | None = None
    mirror: bool = False
    prefix: str | None = None
    timeout: float = 5.0
    wait_replicas: int = 0
    """``WAIT`` for this many replicas after every index write (0: no WAIT)."""
    wait_timeout: float = 0.1
    """Seconds that WAIT may take; fewer replicas by then: the write is not acknowledged (retried)."""

    @property
    def cluster(self) -> bool:
        return bool(self.cluster_nodes)

    @property
    def sentinel(self) -> bool:
        return bool(self.sentinels)

    def client(self) -> Any:
        """A new redis-py asyncio client (``Redis``, a Sentinel-managed ``Redis`` or ``RedisCluster``);
        does not connect."""
        import redis.asyncio as aredis
        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.asyncio.sentinel import Sentinel

        common: dict[str, Any] = {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": min(self.timeout, 2.0),
            "decode_responses": False,
        }
        if self.cluster:
            nodes = [ClusterNode(host, port) for host, port in self.cluster_nodes]
            return RedisCluster(startup_nodes=nodes, username=self.username, password=self.password, **common,
                                **dict(self.node_options))
        if self.sentinel:
            # sentinel_kwargs given: redis-py then copies no option of the data nodes to the sentinels.
            to_sentinels = {**common, **dict(self.sentinel_options)}
            manager = Sentinel(list(self.sentinels), sentinel_kwargs=to_sentinels, **common)
            return manager.master_for(self.service, db=self.db, username=self.username,
                                      password=self.password, **dict(self.node_options))
        return aredis.Redis.from_url(self.url, **common)


@dataclass(frozen=True, slots=True)
class IndexSpec:
    """An index URI parsed once (:func:`parse_index_uri`): what ``open_index``, the engine store and
    the node directory each open from."""

    uri: str
    redis: RedisUri | None
    """Where the Redis index is and its options; None for the memory index."""
    key_prefix: str = "kvcoord"
    """The keyspace prefix in force: the URI's ``prefix`` option, else the configured one."""

    @property
    def backend(self) -> str:
        """``memory``, ``redis`` (standalone or Sentinel) or ``redis-cluster``."""
        if self.redis is None:
            return "memory"
        return "redis-cluster" if self.redis.cluster else "redis"


def _is_redis(uri: str) -> bool:
    return uri.split("://", 1)[0] in SCHEMES and "://" in uri


def _is_memory(uri: str) -> bool:
    return uri in ("", "memory", "memory://")


def parse_index_uri(uri: str, *, key_prefix: str = "kvcoord") -> IndexSpec:
    """The one parser of index URIs. ``ValueError`` (one line, naming what is allowed) for a URI no
    backend takes."""
    if _is_memory(uri):
        return IndexSpec(uri, None, key_prefix)
    if not _is_redis(uri):
        raise ValueError(f"unknown index backend {uri!r}: use 'memory', 'redis://host:port/db', "
                         "'redis+cluster://host:port,host:port' or 'redis+sentinel://host:port,host:port/master-name'")
    parsed = parse_redis_uri(uri)
    return IndexSpec(uri, parsed, parsed.prefix or key_prefix)


def parse_redis_uri(uri: str) -> RedisUri:
    """Split and check a Redis index URI; ``ValueError`` names the bad part and the allowed options."""
    parts = urlsplit(uri)
    query: dict[str, str] = {}
    for item in parts.query.split("&"):
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"index URI {uri!r}: option {item!r} has no value (want name=value)")
        ((name, value),) = parse_qsl(item, keep_blank_values=True)
        if name in query:
            raise ValueError(f"index URI {uri!r}: option {name!r} given twice")
        query[name] = value
    cluster = parts.scheme == "redis+cluster"
    sentinel = parts.scheme == "redis+sentinel"
    allowed = OPTIONS + REDIS_OPTIONS + (CLUSTER_OPTIONS if cluster else SENTINEL_OPTIONS if sentinel else ())
    unknown = sorted(set(query) - set(allowed))
    if unknown:
        raise ValueError(f"index URI {uri!r}: unknown option {unknown[0]!r} (allowed: {', '.join(allowed)})")
    buckets = None
    if "buckets" in query:
        raw = query.pop("buckets")
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"index URI {uri!r}: buckets must be an integer >= 1, not {raw!r}")
        buckets = int(raw)
    mirror = query.pop("mirror", "0")
    if mirror not in ("0", "1"):
        raise ValueError(f"index URI {uri!r}: mirror must be 0 or 1, not {mirror!r}")
    raw_timeout = query.pop("timeout", "5")
    try:
        timeout = float(raw_timeout)
    except ValueError:
        timeout = -1.0
    if not timeout > 0:
        raise ValueError(f"index URI {uri!r}: timeout must be a number of seconds > 0, not {raw_timeout!r}")
    wait_replicas, wait_timeout = _wait_options(uri, query, timeout)
    prefix = query.pop("prefix", None)
    if prefix == "":
        raise ValueError(f"index URI {uri!r}: prefix must not be empty")
    base = RedisUri("", username=_unquote(parts.username), password=_unquote(parts.password), buckets=buckets,
                    mirror=mirror == "1", prefix=prefix, timeout=timeout, wait_replicas=wait_replicas,
                    wait_timeout=wait_timeout)
    if cluster:
        node = _typed_options(uri, query)
        tls_options = sorted(k for k in node if k.startswith("ssl_"))
        if tls_options and not node.get("ssl"):
            raise ValueError(f"index URI {uri!r}: {tls_options[0]} needs ssl=1")
        return replace(base, cluster_nodes=_host_ports(uri, parts.netloc, "cluster node"),
                       node_options=tuple(sorted(node.items())))
    if sentinel:
        return _sentinel_uri(uri, base, parts.netloc, parts.path, query)
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"index URI {uri!r}: no host (want redis://host:port/db)")
    url = urlunsplit(parts._replace(query=urlencode(query)))
    if parts.scheme == "unix" and not parts.netloc:  # urlunsplit drops the empty authority of unix:///path
        url = "unix://" + url.removeprefix("unix:")
    return replace(base, url=url, username=parts.username, password=parts.password)


def _wait_options(uri: str, query: dict[str, str], timeout: float) -> tuple[int, float]:
    """``wait_replicas`` (an integer >= 0) and ``wait_timeout`` (seconds, > 0 and below the socket
    ``timeout``, which would otherwise cut the connection first; WAIT 0 would block forever)."""
    raw = query.pop("wait_replicas", "0")
    if not raw.isdigit():
        raise ValueError(f"index URI {uri!r}: wait_replicas must be an integer >= 0, not {raw!r}")
    raw_timeout = query.pop("wait_timeout", None)
    if raw_timeout is None:
        return int(raw), min(0.1, timeout / 2)
    if not int(raw):
        raise ValueError(f"index URI {uri!r}: wait_timeout needs wait_replicas >= 1")
    try:
        wait_timeout = float(raw_timeout)
    except ValueError:
        wait_timeout = -1.0
    if not 0.001 <= wait_timeout < timeout:
        raise ValueError(f"index URI {uri!r}: wait_timeout must be seconds >= 0.001 and below timeout "
                         f"({timeout:g}), not {raw_timeout!r}")
    return int(raw), wait_timeout


def _unquote(part: str | None) -> str | None:
    return unquote(part) if part is not None else None


def _host_ports(uri: str, netloc: str, what: str) -> tuple[tuple[str, int], ...]:
    """``h1:p1,h2:p2`` after the userinfo: a Cluster's startup nodes or the sentinels."""
    nodes: list[tuple[str, int]] = []
    for hp in netloc.rsplit("@", 1)[-1].split(","):
        host, _, port = hp.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"index URI {uri!r}: bad {what} {hp!r} (want host:port)")
        nodes.append((host.strip("[]"), int(port)))
    return tuple(nodes)


_TYPED: dict[str, Callable[[str], Any]] = {"health_check_interval": int, "socket_keepalive": bool,
                                           "ssl_check_hostname": bool}
"""Cluster and Sentinel options that are not strings (redis-py's URL parser types them for ``redis://``)."""


def _typed_options(uri: str, query: dict[str, str]) -> dict[str, Any]:
    """A Cluster's or Sentinel's redis-py options from the query, typed (flags are ``0`` or ``1``)."""
    node: dict[str, Any] = {}
    for key, raw in query.items():
        convert = _TYPED.get(key, str)
        if convert is int and not raw.isdigit():
            raise ValueError(f"index URI {uri!r}: {key} must be an integer >= 0, not {raw!r}")
        if convert is bool or key in ("ssl", "sentinel_ssl"):
            if raw not in ("0", "1"):
                raise ValueError(f"index URI {uri!r}: {key} must be 0 or 1, not {raw!r}")
            node[key] = raw == "1"
        else:
            node[key] = convert(raw)
    return node


def _sentinel_uri(uri: str, base: RedisUri, netloc: str, path: str, query: dict[str, str]) -> RedisUri:
    """``redis+sentinel://[user:password@]h1:p1,h2:p2/master-name[/db]?…``: the options typed and split
    between the data nodes' connections and the sentinels'."""
    sentinels = _host_ports(uri, netloc, "sentinel")
    name, _, db = path.strip("/").partition("/")
    if not name:
        raise ValueError(f"index URI {uri!r}: no master name (want redis+sentinel://host:port/master-name)")
    if db and not db.isdigit():
        raise ValueError(f"index URI {uri!r}: db must be an integer >= 0, not {db!r}")
    node = _typed_options(uri, query)
    to_sentinels: dict[str, Any] = {k: v for k, v in node.items() if k.startswith("ssl_")}
    for key in ("sentinel_username", "sentinel_password", "sentinel_ssl"):
        if key in node:
            to_sentinels[key.removeprefix("sentinel_")] = node.pop(key)
    tls_options = sorted(k for k in node if k.startswith("ssl_"))
    if tls_options and not (node.get("ssl") or to_sentinels.get("ssl")):
        raise ValueError(f"index URI {uri!r}: {tls_options[0]} needs ssl=1 (data nodes) or sentinel_ssl=1")
    if not to_sentinels.get("ssl"):  # an ssl_* option is for the side(s) with TLS on
        to_sentinels = {k: v for k, v in to_sentinels.items() if not k.startswith("ssl")}
    if not node.get("ssl"):
        node = {k: v for k, v in node.items() if not k.startswith("ssl")}
    return replace(base, url=uri, sentinels=sentinels, service=unquote(name), db=int(db or 0),
                   node_options=tuple(sorted(node.items())),
                   sentinel_options=tuple(sorted(to_sentinels.items())))
