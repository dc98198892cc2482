"""Generated protobuf and gRPC modules (``kvcoord.proto.v2``); sources in ``proto/kvcoord/v2``."""
