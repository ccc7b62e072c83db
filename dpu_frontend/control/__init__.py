"""The control plane: bootstrap of a channel between the daemon and a GPU peer.

A TCP connection to the peer's host process carries a few msgpack frames:
``hello`` (daemon: protocol version, channel wanted, its QP), then
``welcome`` (peer: channel granted, region address and rkey or shm path, its
QP, the model's special token ids) or ``refuse``. The connection then stays
open for the life of the channel: its closing tells either side that the
other went away. No token ever crosses it.
"""
