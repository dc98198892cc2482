"""Engine-side pieces: the block pool, the ZMQ relay for real engines, and the reporter that streams to
the coordinator."""
