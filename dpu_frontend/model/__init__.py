"""The model behind the ring: a Qwen3 decoder with a paged KV cache, continuous
batching and sampling on the GPU.

The modules that need no GPU (``config``, ``checkpoint``, ``sampling``,
``blocks``, ``scheduler``) import neither torch nor Triton and are tested in
CI; ``kernels``, ``qwen3``, ``sampler``, ``runner`` and ``engine`` run on the
GPU machine.
"""
