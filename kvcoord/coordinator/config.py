"""Coordinator configuration: a TOML file, then ``KVCOORD_*`` environment variables, then flags.

Later sources win. Unknown keys are errors, so a typo never silently falls back to a default.
The file format is documented in :data:`EXAMPLE_TOML`.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from kvcoord.coordinator.config_auth import AuthConfig, merge_flag_tokens, parse_auth
from kvcoord.coordinator.config_values import (
    ConfigError,
    as_bool,
    as_float,
    as_int,
    as_str,
    as_table,
    check_hostport,
    check_keys,
    learn_seed,
)
from kvcoord.coordinator.pools import PoolConfig, parse_pools
from kvcoord.coordinator.reservations import HOLD_SECONDS
from kvcoord.events import DEFAULT_TIER_WEIGHTS, Tier
from kvcoord.extra_keys import ExtraKeyStyle
from kvcoord.hashing import EXTRA_KEY_STYLES, PROFILE_ALGOS, HashAlgo, HashProfile
from kvcoord.index.uri import parse_index_uri
from kvcoord.media import parse_media
from kvcoord.tokenize import TokenizerSpec, is_local_directory
from kvcoord.tokenize.base import ChatTemplateContentFormat
from kvcoord.tokenize.media import DEFAULT_IMAGE_PLACEHOLDER, DEFAULT_IMAGE_TOKENS, MediaRule

EXAMPLE_TOML = """\
listen = "127.0.0.1:50051"          # gRPC HOST:PORT
metrics_listen = "127.0.0.1:9400"   # Prometheus HOST:PORT; "" disables
http_listen = "127.0.0.1:8090"      # HTTP API (Dynamo's indexer API) HOST:PORT; "" disables
index = "memory"                    # memory | redis://host:port/db | redis+cluster://h:p,...
index_key_prefix = "kvcoord"
lease_seconds = 10.0                # a node silent this long vanishes from lookups
lookup_deadline = 0.5               # seconds a lookup waits for the index; then UNAVAILABLE / 503
state_dir = "/var/lib/kvcoord"      # memory index: engines registered over HTTP survive a restart
                                    # (kept in engines.json there); "" (default): forgotten at exit
strict_models = false               # true: only the models below may ingest or be queried
lookup_workers = 0                  # memory index: N more processes answer HTTP lookups on http_listen
replica_silent_seconds = 3.0        # Redis: a coordinator replica silent this long has its routers'
                                    # reservations dropped on the others (at least 2)
reservation_hold_seconds = 0.25     # a router's lookup holds its new prefix this long for its pick; other
                                    # lookups of it (on any replica) wait at most that for the pick

[tier_weights]                      # orders lookup answers: sum of per-tier matched blocks x weight
GPU = 1.0
CPU = 0.8
STORAGE = 0.5

[media]                             # medium name (any case) = "GPU" | "CPU" | "STORAGE", over the defaults;
LMCACHE_REMOTE = "STORAGE"          # a name no map knows: its events are skipped and counted

[pools.lmcache-remote]              # a shared pool: its blocks count, at its tier's weight (default
tier = "STORAGE"                    # STORAGE), for the nodes reaching it (also: agent --pool, /register)
nodes = ["node-a"]

[limits]
max_message_bytes = 16777216
max_events_per_batch = 4096
max_query_blocks = 8192
max_snapshot_blocks = 16777216
max_staged_snapshot_blocks = 33554432  # unfinished snapshots over all streams (~9 bytes a block)
max_hashes_per_batch = 262144       # block hashes over all events of one batch
max_entries_per_node = 16777216     # entries (block, rank, tier) one node may hold, over its ranks
max_streams = 10000                 # concurrent ingest streams (as Redis' maxclients)
hello_timeout_s = 5.0               # a stream that sends no Hello this long is closed
http_header_timeout_s = 10.0        # HTTP API: a request head must arrive within this (408, closed)
http_max_header_bytes = 65536       # HTTP API: request line and headers at most (431)
http_max_connections = 1024         # HTTP API: open connections at most (one more: 503, closed)
http_idle_timeout_s = 75.0          # HTTP API: a kept-alive connection idle this long is closed

[verify]                            # engine hash verification on a sample of BlockStored chains
enabled = true
first = 4                           # always verify a node's first N verifiable chains
sample_every = 32                   # then 1 in N
lru_size = 65536                    # uint64 -> digest of recently verified blocks (to verify continuations)

[tls]                               # all optional; client_ca turns on mutual TLS
cert = "/etc/kvcoord/server.crt"
key = "/etc/kvcoord/server.key"
client_ca = "/etc/kvcoord/ca.crt"

[[auth.agent_tokens]]               # any token configured turns auth on for every RPC
token = "secret-a"                  # or token_env = "VAR" or token_file = "/path"
nodes = ["node-a", "node-b"]        # node ids this token may publish for ("*" = any)

[[auth.router_tokens]]              # query only: Lookup, ListNodes, Stats, Ping
token_env = "KVCOORD_ROUTER_TOKEN"

[[auth.admin_tokens]]               # everything, including DrainNode/RemoveNode of any node
token_file = "/etc/kvcoord/admin.token"

[models."Qwen/Qwen3-0.6B"]
algo = "sha256_cbor"                # sha256 | sha256_cbor | xxhash | xxhash_cbor
block_size = 16
seed = "42"                         # NONE_HASH seed; default: $PYTHONHASHSEED (or the release default)
style = "untagged"                  # untagged | tagged; default from engine_release, else untagged
engine_release = "0.30"             # optional: vLLM release whose defaults apply
tokenizer = "/models/Qwen3-0.6B"    # optional, for lookups by prompt or chat: a local Hugging Face
                                    # tokenizer directory, or the engine URL http://vllm:8000 (its /tokenize)
# chat_template = "template.jinja"  # as the engine's --chat-template (local tokenizers only)
"""

ENV_VARS: dict[str, str] = {
    "KVCOORD_CONFIG": "config",
    "KVCOORD_LISTEN": "listen",
    "KVCOORD_METRICS_LISTEN": "metrics_listen",
    "KVCOORD_HTTP_LISTEN": "http_listen",
    "KVCOORD_INDEX": "index",
    "KVCOORD_INDEX_KEY_PREFIX": "index_key_prefix",
    "KVCOORD_LEASE_SECONDS": "lease_seconds",
    "KVCOORD_LOOKUP_DEADLINE": "lookup_deadline",
    "KVCOORD_STATE_DIR": "state_dir",
    "KVCOORD_STRICT_MODELS": "strict_models",
    "KVCOORD_LOOKUP_WORKERS": "lookup_workers",
    "KVCOORD_REPLICA_SILENT_SECONDS": "replica_silent_seconds",
    "KVCOORD_RESERVATION_HOLD_SECONDS": "reservation_hold_seconds",
    "KVCOORD_MAX_MESSAGE_BYTES": "max_message_bytes",
    "KVCOORD_MAX_EVENTS_PER_BATCH": "max_events_per_batch",
    "KVCOORD_MAX_QUERY_BLOCKS": "max_query_blocks",
    "KVCOORD_MAX_HASHES_PER_BATCH": "max_hashes_per_batch",
    "KVCOORD_MAX_ENTRIES_PER_NODE": "max_entries_per_node",
    "KVCOORD_MAX_STREAMS": "max_streams",
    "KVCOORD_MAX_STAGED_SNAPSHOT_BLOCKS": "max_staged_snapshot_blocks",
    "KVCOORD_HELLO_TIMEOUT_S": "hello_timeout_s",
    "KVCOORD_HTTP_HEADER_TIMEOUT_S": "http_header_timeout_s",
    "KVCOORD_HTTP_MAX_HEADER_BYTES": "http_max_header_bytes",
    "KVCOORD_HTTP_MAX_CONNECTIONS": "http_max_connections",
    "KVCOORD_HTTP_IDLE_TIMEOUT_S": "http_idle_timeout_s",
    "KVCOORD_TLS_CERT": "tls_cert",
    "KVCOORD_TLS_KEY": "tls_key",
    "KVCOORD_TLS_CLIENT_CA": "tls_client_ca",
}
"""Environment variable -> override key (same keys as :func:`load_config`'s ``overrides``)."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model's hash profile (None: learned from the events, trying ``seed`` too, see :mod:`.learn`)
    and, for lookups by prompt or chat, its tokenizer."""

    name: str
    profile: HashProfile | None
    tokenizer: TokenizerSpec | None = None
    seed: str | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    max_message_bytes: int = 16 * 1024 * 1024
    max_events_per_batch: int = 4096
    max_query_blocks: int = 8192
    max_snapshot_blocks: int = 1 << 24
    max_staged_snapshot_blocks: int = 1 << 25
    """Blocks of unfinished snapshots held over all streams: the memory they may take (~9 bytes each)."""
    max_hashes_per_batch: int = 1 << 18
    """Block hashes over every event of one batch (``max_events_per_batch`` counts events only)."""
    max_entries_per_node: int = 1 << 24
    """Entries one node may hold over its ranks (an upper-bound count the coordinator keeps)."""
    max_streams: int = 10000
    """Concurrent ingest streams, as Redis' ``maxclients``: one more is refused with RESOURCE_EXHAUSTED."""
    hello_timeout_s: float = 5.0
    """Seconds a new ingest stream has to send its Hello before it is closed (DEADLINE_EXCEEDED)."""
    http_header_timeout_s: float = 10.0
    """The HTTP API's :class:`~kvcoord.coordinator.httpd.HttpLimits` (a slow client's head: 408)."""
    http_max_header_bytes: int = 64 * 1024
    http_max_connections: int = 1024
    http_idle_timeout_s: float = 75.0


@dataclass(frozen=True, slots=True)
class VerifyConfig:
    enabled: bool = True
    first: int = 4
    sample_every: int = 32
    lru_size: int = 65536


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    listen: str = "127.0.0.1:50051"
    metrics_listen: str = "127.0.0.1:9400"
    http_listen: str = "127.0.0.1:8090"
    """The HTTP API (:mod:`kvcoord.coordinator.httpapi`); "" disables it."""
    index: str = "memory"
    index_key_prefix: str = "kvcoord"
    lease_seconds: float = 10.0
    lookup_deadline: float = 0.5
    """Seconds a lookup waits for a remote index before answering UNAVAILABLE (a failover never hangs it)."""
    state_dir: str = ""
    """With the memory index, where registrations (``POST /register``) are kept across restarts ("" none;
    the Redis index keeps them in Redis)."""
    strict_models: bool = False
    lookup_workers: int = 0
    """Processes that answer the HTTP lookups on ``http_listen`` (memory index), fed by this one
    (:mod:`kvcoord.coordinator.workers`); 0: this process answers them."""
    replica_silent_seconds: float = 3.0
    """A replica on the same Redis heard from no reservation feed entry this long (killed, or cut off) has
    its routers' reservations dropped here (:mod:`kvcoord.coordinator.reservation_sync`)."""
    reservation_hold_seconds: float = HOLD_SECONDS
    """How long a router's lookup holds its new prefix for the pick it will reserve: another router's
    lookup of the same prefix, here or on another replica, waits at most that long to see the pick."""
    models: Mapping[str, ModelConfig] = field(default_factory=dict)
    tier_weights: tuple[float, float, float] = DEFAULT_TIER_WEIGHTS
    media: Mapping[str, Tier] = field(default_factory=dict)
    """``[media]``: medium names over :data:`kvcoord.media.DEFAULT_MEDIA` (put in force at start)."""
    pools: Mapping[str, PoolConfig] = field(default_factory=dict)
    """``[pools.NAME]``: shared pools, their tiers and the nodes reaching them (kvcoord.coordinator.pools)."""
    limits: Limits = field(default_factory=Limits)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    stats_interval: float = 2.0
    """Seconds between index stats / ping refreshes (gauges and health)."""

    learned: dict[str, HashProfile] = field(default_factory=dict, compare=False)
    """Profiles learned from the events of models configured without one (:mod:`.learn` adds them)."""

    def profile(self, model: str) -> HashProfile | None:
        m = self.models.get(model)
        return m.profile if m is not None and m.profile is not None else self.learned.get(model)


def env_seed() -> str | None:
    """``$PYTHONHASHSEED`` as a NONE_HASH seed, or None when unset or ``random``."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None or seed == "" or seed == "random":
        return None
    return seed


_TOKENIZER_KEYS = {"tokenizer", "chat_template", "chat_template_content_format",
                   "default_chat_template_kwargs", "tokenizer_timeout", "image_tokens", "image_placeholder"}
_CONTENT_FORMATS = ("auto", "string", "openai")


def build_model(where: str, name: str, table: Mapping[str, Any], default_seed: str | None,
                base: Path | None = None) -> ModelConfig:
    """A ``[models."NAME"]`` table (or ``--model`` spec): the hash profile, and the tokenizer if named (a
    local directory, relative to ``base``, an engine's ``http(s)://`` URL whose ``/tokenize`` is used, or
    ``sim:toktok``, the sim-engine's toy tokenizer)."""
    hints = {k: v for k, v in table.items() if k not in _TOKENIZER_KEYS}
    profile = build_profile(where, hints, default_seed) if "algo" in hints else None
    seed = default_seed if profile is not None else learn_seed(where, hints, default_seed)
    if "tokenizer" not in table:
        extra = sorted(_TOKENIZER_KEYS & set(table))
        if extra:
            raise ConfigError(f"{where}: {', '.join(extra)} need 'tokenizer'")
        return ModelConfig(name, profile, seed=seed)

    def local(key: str) -> str:
        value = as_str(f"{where}.{key}", table[key])
        if not is_local_directory(value) or base is None:
            return value
        return str(base / value)

    content_format = as_str(f"{where}.chat_template_content_format",
                             table.get("chat_template_content_format", "auto"))
    if content_format not in _CONTENT_FORMATS:
        raise ConfigError(f"{where}.chat_template_content_format: {content_format!r} is not one of "
                          f"{', '.join(_CONTENT_FORMATS)}")
    kwargs = table.get("default_chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{where}.default_chat_template_kwargs: expected a table")
    source = local("tokenizer")
    if is_local_directory(source):
        from kvcoord.tokenize.base import TokenizeError
        from kvcoord.tokenize.local import check_directory

        try:
            check_directory(name, source)
        except TokenizeError as exc:
            raise ConfigError(f"{where}: tokenizer {exc.source}: {exc.reason}") from None
    spec = TokenizerSpec(
        source,
        timeout=as_float(f"{where}.tokenizer_timeout", table.get("tokenizer_timeout", 5.0)),
        chat_template=local("chat_template") if "chat_template" in table else None,
        chat_template_content_format=cast(ChatTemplateContentFormat, content_format),
        default_chat_template_kwargs=kwargs,
        media=MediaRule(as_str(f"{where}.image_placeholder", table.get("image_placeholder",
                                                                       DEFAULT_IMAGE_PLACEHOLDER)),
                        as_int(f"{where}.image_tokens", table.get("image_tokens", DEFAULT_IMAGE_TOKENS))),
    )
    return ModelConfig(name, profile, spec, seed)


def build_profile(where: str, table: Mapping[str, Any], default_seed: str | None) -> HashProfile:
    """A hash profile from a ``[models.NAME]`` table (or the equivalent ``--model`` spec)."""
    check_keys(where, table, {"algo", "block_size", "seed", "style", "engine_release"} | _TOKENIZER_KEYS)
    if "algo" not in table or "block_size" not in table:
        raise ConfigError(f"{where}: 'algo' and 'block_size' are required")
    algo_s = as_str(f"{where}.algo", table["algo"])
    if algo_s not in PROFILE_ALGOS:
        raise ConfigError(f"{where}.algo: {algo_s!r} is not one of {', '.join(PROFILE_ALGOS)}")
    algo: HashAlgo = algo_s
    block_size = as_int(f"{where}.block_size", table["block_size"])
    # SGLang's chain has no seed: the global --hash-seed is vLLM's; an explicit seed= is an error.
    seed_v = table.get("seed", None if algo == "sglang" else default_seed)
    if seed_v is not None and (isinstance(seed_v, bool) or not isinstance(seed_v, str | int)):
        raise ConfigError(f"{where}.seed: expected a string, got {seed_v!r}")
    seed = None if seed_v is None else str(seed_v)
    style: ExtraKeyStyle | None = None
    if "style" in table:
        style_s = as_str(f"{where}.style", table["style"])
        if style_s not in EXTRA_KEY_STYLES:
            raise ConfigError(f"{where}.style: {style_s!r} is not one of {', '.join(EXTRA_KEY_STYLES)}")
        style = style_s
    release = table.get("engine_release")
    try:
        if release is not None:
            rel = as_str(f"{where}.engine_release", release)
            profile = HashProfile.for_release(rel, algo, block_size, seed=seed)
            if style is not None:
                profile = dataclasses.replace(profile, style=style)
        else:
            profile = HashProfile(algo, block_size, seed=seed, style=style or "untagged")
        profile.none_hash()  # the seed must be known now, not at the first lookup
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return profile


def parse_model_spec(spec: str, default_seed: str | None) -> ModelConfig:
    """``NAME,algo=sha256_cbor,block_size=16[,seed=S][,style=tagged][,engine_release=0.31][,tokenizer=T]``, or
    ``NAME[,seed=S][,tokenizer=T]`` for a profile learned from the events."""
    name, _, rest = spec.partition(",")
    name = name.strip()
    if not name:
        raise ConfigError(
            f"--model {spec!r}: expected NAME,algo=ALGO,block_size=N[,seed=S][,style=S][,engine_release=R]"
        )
    table: dict[str, Any] = {}
    for part in rest.split(",") if rest else ():
        key, eq, value = part.partition("=")
        if not eq:
            raise ConfigError(f"--model {spec!r}: {part!r} is not key=value")
        table[key.strip()] = value.strip()
    return build_model(f"--model {name}", name, table, default_seed, Path.cwd())


def _apply_scalar(values: dict[str, Any], key: str, raw: object, where: str) -> None:
    if key in ("listen",):
        values[key] = check_hostport(where, as_str(where, raw))
    elif key in ("metrics_listen", "http_listen"):
        values[key] = check_hostport(where, as_str(where, raw), allow_empty=True)
    elif key == "index":
        uri = as_str(where, raw)
        try:
            parse_index_uri(uri)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        values[key] = uri
    elif key == "index_key_prefix" or key == "state_dir":
        values[key] = as_str(where, raw)
    elif key in ("lease_seconds", "stats_interval", "lookup_deadline"):
        values[key] = as_float(where, raw)
    elif key == "strict_models":
        values[key] = as_bool(where, raw)
    elif key == "lookup_workers":
        values[key] = as_int(where, raw, minimum=0)
    elif key == "replica_silent_seconds":
        values[key] = as_float(where, raw)
        if values[key] < 2:  # an idle replica writes its heartbeat every second
            raise ConfigError(f"{where}: must be >= 2 (replicas write a heartbeat every second), "
                              f"got {values[key]:g}")
    elif key == "reservation_hold_seconds":
        values[key] = as_float(where, raw)
        if not 0 < values[key] <= 60:
            raise ConfigError(f"{where}: must be in (0, 60], got {values[key]:g}")
    else:  # pragma: no cover - guarded by the callers' key lists
        raise ConfigError(f"{where}: unknown key")


_TOP_SCALARS = {
    "listen",
    "metrics_listen",
    "http_listen",
    "index",
    "index_key_prefix",
    "lease_seconds",
    "lookup_deadline",
    "state_dir",
    "strict_models",
    "stats_interval",
    "lookup_workers",
    "replica_silent_seconds",
    "reservation_hold_seconds",
}
_TOP_TABLES = {"tier_weights", "media", "pools", "limits", "verify", "tls", "auth", "models"}
_LIMIT_KEYS = {f.name for f in dataclasses.fields(Limits)}
_FLOAT_LIMITS = {"hello_timeout_s", "http_header_timeout_s", "http_idle_timeout_s"}


def _as_limit(where: str, key: str, value: object) -> int | float:
    return as_float(where, value) if key in _FLOAT_LIMITS else as_int(where, value)


@dataclass(slots=True)
class _Settings:
    """What the sources have set so far, layer by layer; :meth:`build` checks and freezes it."""

    default_seed: str | None
    values: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    """Limit name -> int (``hello_timeout_s``: float), as :class:`Limits` takes them."""
    tls: dict[str, str | None] = field(default_factory=dict)
    models: dict[str, ModelConfig] = field(default_factory=dict)
    weights: list[float] = field(default_factory=lambda: list(CoordinatorConfig().tier_weights))
    media: dict[str, Tier] = field(default_factory=dict)
    pools: dict[str, PoolConfig] = field(default_factory=dict)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)

    def read_file(self, path: str | os.PathLike[str], env: Mapping[str, str]) -> None:
        """The TOML file: every key checked, relative paths taken from the file's directory."""
        where0 = str(path)
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"config {where0}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {where0}: {exc}") from None
        base = Path(path).resolve().parent
        check_keys(f"config {where0}", data, _TOP_SCALARS | _TOP_TABLES)
        for key in _TOP_SCALARS & set(data):
            _apply_scalar(self.values, key, data[key], f"config {where0}: {key}")
        if self.values.get("state_dir"):  # relative to the file, as its other paths are
            self.values["state_dir"] = str(base / self.values["state_dir"])
        if "tier_weights" in data:
            tw = as_table("tier_weights", data["tier_weights"])
            check_keys("tier_weights", tw, {t.name for t in Tier})
            for t in Tier:
                if t.name in tw:
                    self.weights[t.value] = as_float(f"tier_weights.{t.name}", tw[t.name], positive=False)
        try:
            self.media.update(parse_media(as_table("media", data.get("media", {})), "media"))
            self.pools.update(parse_pools(as_table("pools", data.get("pools", {}))))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if "limits" in data:
            lt = as_table("limits", data["limits"])
            check_keys("limits", lt, _LIMIT_KEYS)
            for k, v in lt.items():
                self.limits[k] = _as_limit(f"limits.{k}", k, v)
        if "verify" in data:
            self.verify = _parse_verify(as_table("verify", data["verify"]))
        if "tls" in data:
            tt = as_table("tls", data["tls"])
            check_keys("tls", tt, {"cert", "key", "client_ca"})
            for k, v in tt.items():
                self.tls[k] = str(base / as_str(f"tls.{k}", v))
        if "auth" in data:
            self.auth = parse_auth("auth", as_table("auth", data["auth"]), base, env)
        if "models" in data:
            for name, raw in as_table("models", data["models"]).items():
                where = f'models."{name}"'
                self.models[name] = build_model(where, name, as_table(where, raw), self.default_seed, base)

    def apply(self, key: str, raw: Any, where: str) -> None:
        """One environment variable or flag (``where`` names it in errors)."""
        if key in _TOP_SCALARS:
            _apply_scalar(self.values, key, raw, where)
        elif key in _LIMIT_KEYS:
            self.limits[key] = _as_limit(where, key, raw)
        elif key in ("tls_cert", "tls_key", "tls_client_ca"):
            self.tls[key.removeprefix("tls_")] = as_str(where, raw)
        elif key == "models":
            for spec in raw:
                m = parse_model_spec(spec, self.default_seed)
                self.models[m.name] = m
        elif key in ("agent_tokens", "router_tokens", "admin_tokens"):
            self.auth = merge_flag_tokens(self.auth, key, raw)
        else:
            raise ConfigError(f"{where}: unknown setting")

    def build(self) -> CoordinatorConfig:
        """The checks that span sources (TLS pairs, strict models), then the frozen configuration."""
        tls_cfg = TlsConfig(**self.tls)
        if (tls_cfg.cert is None) != (tls_cfg.key is None):
            raise ConfigError("tls: cert and key must be given together")
        if tls_cfg.client_ca is not None and tls_cfg.cert is None:
            raise ConfigError("tls: client_ca (mutual TLS) needs cert and key")
        if self.values.get("strict_models") and not self.models:
            raise ConfigError("strict_models is set but no [models] are configured")
        if self.values.get("lookup_workers"):
            if parse_index_uri(self.values.get("index", "memory")).redis is not None:
                raise ConfigError("lookup_workers needs the memory index (with Redis, run replicas with "
                                  "?mirror=1 instead)")
            if not self.values.get("http_listen", "127.0.0.1:8090"):
                raise ConfigError("lookup_workers needs http_listen (the workers serve the HTTP API)")
        weights = self.weights
        return CoordinatorConfig(
            **self.values,
            models=self.models,
            tier_weights=(weights[0], weights[1], weights[2]),
            media=self.media,
            pools=self.pools,
            limits=Limits(**self.limits),
            verify=self.verify,
            tls=tls_cfg,
            auth=self.auth,
        )


def _parse_verify(vt: Mapping[str, Any]) -> VerifyConfig:
    dv = VerifyConfig()
    check_keys("verify", vt, {f.name for f in dataclasses.fields(VerifyConfig)})
    return VerifyConfig(
        enabled=as_bool("verify.enabled", vt.get("enabled", True)),
        first=as_int("verify.first", vt.get("first", dv.first), minimum=0),
        sample_every=as_int("verify.sample_every", vt.get("sample_every", dv.sample_every)),
        lru_size=as_int("verify.lru_size", vt.get("lru_size", dv.lru_size)),
    )


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> CoordinatorConfig:
    """Defaults, then the TOML file, then ``KVCOORD_*`` env vars, then ``overrides`` (flags; None = unset).

    Override keys: the top-level scalars, the limit names, ``tls_cert``/``tls_key``/``tls_client_ca``,
    ``models`` (a list of ``--model`` specs, added to/replacing the file's) and ``agent_tokens``
    (``TOKEN=node1,node2`` strings), ``router_tokens``/``admin_tokens`` (token strings).
    """
    env = os.environ if env is None else env
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if path is None:
        path = overrides.get("config") or env.get("KVCOORD_CONFIG") or None
    settings = _Settings(env_seed())
    if path:
        settings.read_file(path, env)
    merged: dict[str, Any] = {}
    for var, key in ENV_VARS.items():
        # An empty value is unset, except for a listener, where "" means off (KVCOORD_HTTP_LISTEN="").
        if key != "config" and (env.get(var) or (var in env and key in ("metrics_listen", "http_listen"))):
            merged[key] = (env[var], var)
    for key, value in overrides.items():
        if key != "config":
            merged[key] = (value, f"--{key.replace('_', '-')}")
    for key, (raw, where) in merged.items():
        settings.apply(key, raw, where)
    return settings.build()
