"""The GPU half of the ring: the CUDA peer (kernel, launcher, registration)."""
