"""The decoders, one module a model, built from ``dpu_frontend.model.layers``; what
each declares (``base.ModelSpec``) is registered in ``dpu_frontend.model.registry``."""
