"""Generated from proto/kvcoord/v2 by scripts/gen_proto.py; do not edit."""
