"""dpu-frontend: the DPU half of CPU-free LLM serving."""

__version__ = "0.1.0"
