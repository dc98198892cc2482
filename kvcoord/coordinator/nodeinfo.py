"""Nodes as ``ListNodes`` and ``Stats`` show them: this replica's records and the other replicas'."""

from __future__ import annotations

from kvcoord.coordinator.config import CoordinatorConfig
from kvcoord.coordinator.registry import NodeRecord, trust_state
from kvcoord.coordinator.shared import SharedNode
from kvcoord.hashing import HashProfile
from kvcoord.load import APPROXIMATE, DEGRADED, HISTORY_LOST, RESYNCING, NodeLoad
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.wire import load_to_proto


def remote_node_info(node: SharedNode, now_wall: float, lease: float) -> pb.NodeInfo:
    """A node another replica holds, as its shared record says; past its lease (counted from when
    that replica last heard from it, as for a local node) or its record's deadline: expired."""
    state = node.state
    if state != "expired" and (now_wall - node.heard > lease or now_wall > node.deadline):
        state = "expired"
    degraded = node.trust_reason if node.trust == DEGRADED else None
    lost = node.trust_cause == HISTORY_LOST  # a replica that predates the cause: a mismatch, as before
    trust, reason, cause = trust_state(None if lost else degraded, resyncing=node.trust == RESYNCING,
                                       expired=state == "expired", history_lost=degraded if lost else None,
                                       no_kv_events=node.trust == APPROXIMATE)
    return pb.NodeInfo(
        node_id=node.node_id,
        model=node.model,
        dp_ranks=list(node.dp_ranks),
        state=state,
        epoch=node.epoch,
        last_heartbeat_age_seconds=max(0.0, now_wall - node.heard),
        load=_load_pb(node.load),
        hash_mismatch=state == "hash_mismatch",
        replica=node.owner,
        serving_url=node.url,
        role=node.role,
        trust=trust,
        trust_reason=reason,
        trust_cause=cause,
    )


def _load_pb(load: NodeLoad) -> pb.Load:
    return load_to_proto(load)


def node_info(rec: NodeRecord, now: float, lease: float) -> pb.NodeInfo:
    state = rec.state
    if state != "expired" and now - rec.last_heard > lease:
        state = "expired"
    trust, reason, cause = rec.trust_at(expired=state == "expired")
    info = pb.NodeInfo(
        node_id=rec.node_id,
        model=rec.model,
        dp_ranks=list(rec.dp_ranks),
        state=state,
        epoch=rec.epoch,
        last_seq=rec.last_seq,
        last_heartbeat_age_seconds=max(0.0, now - rec.last_heard),
        load=_load_pb(rec.load),
        hash_mismatch=rec.hash_mismatch,
        hash_mismatch_reason=rec.hash_mismatch_reason,
        serving_url=rec.serving_url,
        role=rec.role,
        trust=trust,
        trust_reason=reason,
        trust_cause=cause,
    )
    if rec.announced is not None:
        a = rec.announced
        info.hash_profile.CopyFrom(
            pb.HashProfile(
                algo=a.algo,
                block_size=a.block_size,
                style=a.style,
                none_hash_fingerprint=a.none_hash_fingerprint,
                engine_release=a.engine_release,
            )
        )
    return info


def model_profile(config: CoordinatorConfig, model: str) -> tuple[HashProfile, str] | None:
    """The profile ``model``'s tokens are hashed with and its source (``configured`` or ``learned`` from the
    events, :mod:`kvcoord.coordinator.learn`); None while it has none."""
    m = config.models.get(model)
    if m is not None and m.profile is not None:
        return m.profile, "configured"
    learned = config.learned.get(model)
    return None if learned is None else (learned, "learned")


def profile_json(config: CoordinatorConfig, model: str) -> dict[str, object] | None:
    """:func:`model_profile` as JSON (``/workers``): algo, block size, style, source; never the seed."""
    found = model_profile(config, model)
    if found is None:
        return None
    p, source = found
    return {"algo": p.algo, "block_size": p.block_size, "style": p.style, "source": source}


def with_model_profile(info: pb.NodeInfo, config: CoordinatorConfig) -> pb.NodeInfo:
    """``info`` with its model's profile (``model_profile``, ``model_profile_source``) filled in."""
    found = model_profile(config, info.model)
    if found is not None:
        p, source = found
        info.model_profile.CopyFrom(pb.HashProfile(algo=p.algo, block_size=p.block_size, style=p.style))
        info.model_profile_source = source
    return info
