"""The layers every decoder is built from, one module a layer, no model names inside:
``linear`` (and its tiles), ``norm`` (RMSNorm), ``rope`` (the rotary table and
kernel), ``attention`` (paged attention and its step metadata), ``activation``
(SwiGLU), ``moe`` (a mixture of experts' router, grouped products and sum),
``quant`` (FP8), ``sampler`` (the draw, on the GPU), ``collective`` (tensor
parallelism's sums over ranks, in rank order).

Every kernel here is **batch-invariant**: a row's result does not depend on
how many other rows share the launch or where it sits among them. Each output
element is reduced in one fixed order, set by the weight's shape and the dtype,
never by the batch size (cuBLAS picks its algorithm, split-K included, by M,
and a sequence's logits would then change with the batch). What may change
with the number of rows is only what leaves that order alone: the linear
layer's tile (its rows, columns, K block, warps and stages). That is what
makes a seeded sequence's tokens the same alone and inside a batch, and a
prompt prefilled in chunks the same as in one pass.
"""
