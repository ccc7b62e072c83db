"""Transports: how the daemon's ring operations reach the peer's memory."""
