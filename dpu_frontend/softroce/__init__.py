"""Soft-RoCE: a real RDMA device on any host, natively or in a micro-VM."""
