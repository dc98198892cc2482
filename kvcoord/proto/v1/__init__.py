"""Generated from proto/kvcoord/v1 by scripts/gen_proto.py; do not edit."""
