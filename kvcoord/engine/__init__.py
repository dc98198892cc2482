"""What engines speak: vLLM's ZMQ KV-event publisher and replay socket, engines' gRPC ``SubscribeKvEvents``
streams, and the relay that follows one engine's stream (gaps, restarts, a mirror of its blocks).

Below the coordinator, because the coordinator relays registered engines itself; the agent relays the
same way from the engine's host.
"""
