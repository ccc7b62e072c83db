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

_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass
class Params:
    #: A layer's parameters; with ``fp8``, its linear weights (``Param.linear``) in FP8.
    layers: list[dict[str, Weight]]
    #: The embedding, the head (the embedding's tensor itself when tied), the final norm.
    top: dict[str, torch.Tensor]

    @classmethod
    def random(cls, table: WeightTable, config: ModelConfig, dtype: torch.dtype,
               device: torch.device, seed: int, *, fp8: bool = False) -> Params:
        """Seeded random weights built on the GPU: real arithmetic, gibberish text.

        Drawn parameter by parameter in the table's order, each packed parameter in one
        draw (the layers first, then the embedding, the head and the final norm), so a
        seed gives the same weights whatever reads them; ``fp8``: each layer's linear
        weights quantized as they are drawn (the same draws as without).
        """
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)

        def draw(param: Param) -> torch.Tensor:
            shapes = [part.shape(config) for part in param.parts_for(config)]
            shape = (sum(s[0] for s in shapes), *shapes[0][1:])
            mean, std = (1.0, 0.1) if param.init == "norm" else (0.0, 0.02)
            t = torch.empty(shape, dtype=torch.float32, device=device)
            return t.normal_(mean, std, generator=gen).to(dtype)

        store = _storage(fp8)
        layers = [{p.name: store(p, draw(p)) for p in table.layer}
                  for _ in range(config.num_layers)]
        return cls(layers, _tied({p.name: draw(p) for p in table.top_params(config)}))

    @classmethod
    def load(cls, table: WeightTable, checkpoint: Checkpoint | GgufCheckpoint, config: ModelConfig,
             dtype: torch.dtype, device: torch.device, *, fp8: bool = False) -> Params:
        """Every tensor copied from the mapped files to the device, in ``dtype``; a packed
        parameter's parts concatenated in the table's order; ``fp8``: each layer's linear
        weights quantized as they arrive."""

        def get(name: str) -> torch.Tensor:
            ref = checkpoint.tensors[name]
            host = torch.frombuffer(checkpoint.data(name), dtype=_TORCH_DTYPES[ref.dtype])
            return host.view(ref.shape).to(device=device, dtype=dtype)

        def param(prefix: str, p: Param) -> torch.Tensor:
            parts = [get(prefix + part.hf) for part in p.parts_for(config)]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        store = _storage(fp8)
        layers = [{p.name: store(p, param(LAYER_PREFIX.format(n=n), p)) for p in table.layer}
                  for n in range(config.num_layers)]
        return cls(layers, _tied({p.name: param("", p) for p in table.top_params(config)}))

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


def _tied(top: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The head is the embedding itself when the config ties them (no tensor of its own)."""
    return top if HEAD in top else top | {HEAD: top[EMBED]}
