"""A decoder's weights on the device, driven by its ``WeightTable``.

``Params`` holds each parameter by the table's name: one dict a layer, one for
the rest. The table says which HF tensors are packed into each parameter, so
one loader, one random initializer and one state dict serve every model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dpu_frontend.model.checkpoint import Checkpoint
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.gguf_checkpoint import GgufCheckpoint
from dpu_frontend.model.layers.quant import Fp8Weight, Weight, dequantize, quantize_weight
from dpu_frontend.model.models.base import EMBED, HEAD, LAYER_PREFIX, Param, WeightTable
from dpu_frontend.model.tensor_parallel import Shard

_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass
class Params:
    #: A layer's parameters; with ``fp8``, its linear weights (``Param.linear``) in FP8.
    layers: list[dict[str, Weight]]
    #: The embedding, the head (the embedding's tensor itself when tied), the final norm.
    top: dict[str, torch.Tensor]

    @classmethod
    def random(cls, table: WeightTable, config: ModelConfig, dtype: torch.dtype,
               device: torch.device, seed: int, *, fp8: bool = False,
               shard: Shard | None = None) -> Params:
        """Seeded random weights built on the GPU: real arithmetic, gibberish text.

        Drawn parameter by parameter in the table's order, each packed parameter in one
        draw (the layers first, then the embedding, the head and the final norm), so a
        seed gives the same weights whatever reads them; ``fp8``: each layer's linear
        weights quantized as they are drawn (the same draws as without). ``shard``: a
        rank's cut of the same draws (tensor parallelism), so that a seed gives one
        model whatever the number of ranks; with ``fp8`` the cut is quantized, its
        scales over the rank's own columns, so an FP8 model's column-split weights
        (o_proj, down) differ in their scales from one rank's.
        """
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)

        def draw(param: Param) -> torch.Tensor:
            shapes = [part.shape(config) for part in param.parts_for(config)]
            shape = (sum(s[0] for s in shapes), *shapes[0][1:])
            mean, std = (1.0, 0.1) if param.init == "norm" else (0.0, 0.02)
            t = torch.empty(shape, dtype=torch.float32, device=device)
            return t.normal_(mean, std, generator=gen).to(dtype)

        def cut(param: Param, packed: torch.Tensor) -> torch.Tensor:
            if shard is None:
                return packed
            rows = [part.shape(config)[0] for part in param.parts_for(config)]
            return shard.take(param, list(packed.split(rows)), torch.cat).contiguous()

        store = _storage(fp8)
        layers = [{p.name: store(p, cut(p, draw(p))) for p in table.layer}
                  for _ in range(config.num_layers)]
        return cls(layers, _top({p.name: cut(p, draw(p)) for p in table.top_params(config)},
                                shard))

    @classmethod
    def load(cls, table: WeightTable, checkpoint: Checkpoint | GgufCheckpoint, config: ModelConfig,
             dtype: torch.dtype, device: torch.device, *, fp8: bool = False,
             shard: Shard | None = None) -> Params:
        """Every tensor copied from the mapped files to the device, in ``dtype``; a packed
        parameter's parts concatenated in the table's order; ``fp8``: each layer's linear
        weights quantized as they arrive. ``shard``: only a rank's rows and columns of
        each tensor (tensor parallelism), cut from the mapped files before the copy."""

        def host(name: str) -> torch.Tensor:
            ref = checkpoint.tensors[name]
            data = torch.frombuffer(checkpoint.data(name), dtype=_TORCH_DTYPES[ref.dtype])
            return data.view(ref.shape)

        def param(prefix: str, p: Param) -> torch.Tensor:
            names = [prefix + part.hf for part in p.parts_for(config)]
            if shard is not None:
                cut = shard.take(p, [host(name) for name in names], torch.cat)
                return cut.to(device=device, dtype=dtype).contiguous()
            parts = [host(name).to(device=device, dtype=dtype) for name in names]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        store = _storage(fp8)
        layers = [{p.name: store(p, param(LAYER_PREFIX.format(n=n), p)) for p in table.layer}
                  for n in range(config.num_layers)]
        return cls(layers, _top({p.name: param("", p) for p in table.top_params(config)}, shard))

    def state_dict(self, table: WeightTable, config: ModelConfig) -> dict[str, torch.Tensor]:
        """HF's names for these weights (the tests hand them to ``transformers``): each
        packed parameter cut back into its parts, an FP8 one dequantized to the dtype of
        the rest."""
        out: dict[str, torch.Tensor] = {}
        dtype = self.top[EMBED].dtype

        def unpack(prefix: str, p: Param, weight: Weight) -> None:
            tensor = dequantize(weight, dtype) if isinstance(weight, Fp8Weight) else weight
            start = 0
            for part in p.parts_for(config):
                rows = part.shape(config)[0]
                out[prefix + part.hf] = tensor[start:start + rows]
                start += rows

        for n, layer in enumerate(self.layers):
            for p in table.layer:
                unpack(LAYER_PREFIX.format(n=n), p, layer[p.name])
        for p in table.top_params(config):
            unpack("", p, self.top[p.name])
        return out


def _storage(fp8: bool) -> Callable[[Param, torch.Tensor], Weight]:
    """How a layer's parameter is kept: as it is, or in FP8 where it is a linear weight."""
    def store(param: Param, tensor: torch.Tensor) -> Weight:
        return quantize_weight(tensor) if fp8 and param.linear else tensor
    return store


def _top(top: dict[str, torch.Tensor], shard: Shard | None) -> dict[str, torch.Tensor]:
    """The head is the embedding itself when the config ties them (no tensor of its own),
    or a rank's rows of it."""
    if HEAD in top:
        return top
    return top | {HEAD: top[EMBED] if shard is None else shard.tied_head(top[EMBED])}
