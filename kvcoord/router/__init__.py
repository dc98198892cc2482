"""Routing: the coordinator client and placement policies."""
