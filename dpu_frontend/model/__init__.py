"""The model behind the ring: decoders with a paged KV cache, continuous batching and
sampling on the GPU.

``registry`` maps a config's architecture to its spec (``models/base.py``) and
decoder (``models/``), built from ``layers/``. The modules that need no GPU
(``config``, ``registry``, ``models/base``, ``checkpoint``, ``sampling``, ``blocks``,
``scheduler``, ``metadata``, ``device/sched_core``) import neither torch nor Triton
and are tested in CI; ``layers``, the decoders, ``weights``, ``runner`` and
``engine`` run on the GPU machine.
"""
