"""Generated protobuf and gRPC modules (``kvcoord.proto.v1``); sources in ``proto/kvcoord/v1``."""
