"""The coordinator: gRPC servicer, ingest ordering, node registry and leases, metrics, TLS and auth.

``CoordinatorServer(config, index=...)`` runs it in-process; ``kvcoord serve`` runs it as a command.
"""

from __future__ import annotations

from kvcoord.coordinator.config import CoordinatorConfig, load_config
from kvcoord.coordinator.server import CoordinatorServer

__all__ = ["CoordinatorConfig", "CoordinatorServer", "load_config"]
