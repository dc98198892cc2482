"""The coordinator: gRPC servicer, ingest ordering, node registry and leases, metrics, TLS and auth.

``CoordinatorServer(config, index=...)`` (``server.py``, its config from ``config.load_config``) runs it
in-process; ``kvcoord serve`` runs it as a command.
"""
