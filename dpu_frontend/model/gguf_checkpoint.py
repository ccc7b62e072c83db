"""A llama-architecture GGUF file read as a Hugging Face checkpoint: the config.json its
metadata describes, HF's name for each of its tensors, and each tensor as HF holds it,
dequantized to float32.

llama.cpp's converter (``convert_hf_to_gguf.py``) renames HF's tensors
(``model.layers.0.self_attn.q_proj.weight`` is ``blk.0.attn_q.weight``), reverses
their dimensions (GGUF lists the fastest first), and permutes the rows of q_proj and
k_proj within each head, from HF's rotate-half layout to the interleaved pairs its
rotary kernel takes. ``hf_tensor`` undoes all three, so that the engine's loader sees
the checkpoint HF's classes would. A file that needs something this does not undo (a
rope-scaling table, a tensor of no known name) is refused with a ``GgufError``.

``dequantize`` widens the element types a served model holds (F32, F16, BF16, and the
block formats Q8_0, Q4_0 and Q4_1) to float32 with the arithmetic of llama.cpp's
reference (``gguf.quants``, which the tests hold it to, bit for bit, on every tensor of
SmolLM2-135M's file too).

``load_config`` and ``GgufCheckpoint`` are what ``model-peer --weights FILE.gguf``
uses: the ``ModelConfig`` of the header, and the tensors checked against its weight
table and handed to ``weights.Params.load`` as a safetensors checkpoint's are.

No torch: CI checks the mapping on files it writes; the model peer moves the float32
arrays to the GPU in its dtype, a tensor at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpu_frontend.errors import StartupError
from dpu_frontend.gguf import BLOCKS, GgufError, GgufFile, TensorType, open_gguf
from dpu_frontend.model.checkpoint import check_tensors, expected_shapes
from dpu_frontend.model.config import ModelConfig

#: ``general.architecture`` -> config.json's ``architectures`` and ``model_type``.
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama")}
#: Tensors outside the layers: GGUF name -> HF name.
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
#: A layer's tensors: GGUF's ``blk.{n}.NAME.weight`` -> HF's ``model.layers.{n}.NAME.weight``.
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
_LAYER = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")


def hf_config(f: GgufFile) -> dict[str, Any]:
    """The HF config.json of the model in ``f`` (keys as transformers' GGUF reader maps
    them); GgufError naming the field that is missing or not served."""
    m = f.metadata
    arch = m.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufError(f"general.architecture {arch!r}: this engine reads "
                        f"{', '.join(ARCHITECTURES)} GGUF files")
    architecture, model_type = ARCHITECTURES[arch]

    def need(key: str) -> Any:
        value = m.get(f"{arch}.{key}")
        if value is None:
            raise GgufError(f"metadata {arch}.{key} is missing")
        return value

    if "rope_freqs.weight" in f.tensors or m.get(f"{arch}.rope.scaling.type", "none") != "none":
        raise GgufError("the file scales RoPE (Llama 3.1's rope_freqs, or rope.scaling): "
                        "not implemented by this engine")
    heads = need("attention.head_count")
    hidden = need("embedding_length")
    tokens = m.get("tokenizer.ggml.tokens")
    embed = f.tensors.get("token_embd.weight")
    if embed is None:
        raise GgufError("no token_embd.weight")
    vocab = m.get(f"{arch}.vocab_size", len(tokens) if tokens else embed.shape[0])
    config: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": m.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": m.get(f"{arch}.rope.dimension_count", hidden // heads),
        "max_position_embeddings": need("context_length"),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "rope_theta": float(m.get(f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": vocab,
        # No output.weight: the head is the embedding (SmolLM2's file).
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos"):
        token = m.get(f"tokenizer.ggml.{key}_token_id")
        if token is not None:
            config[f"{key}_token_id"] = token
    return config


def hf_name(name: str) -> str:
    """HF's name of the GGUF tensor ``name``; GgufError for one of no known name."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = _LAYER.fullmatch(name)
    if match is None or match.group(2) not in LAYER_NAMES:
        raise GgufError(f"tensor {name!r} has no counterpart in a llama checkpoint")
    return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}.weight"


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of q_proj or k_proj ([heads x head_dim, K]) from llama.cpp's interleaved pairs
    back to HF's halves: within each head, row 2i + j of the file is row i + j x
    head_dim / 2 of HF's (the inverse of the converter's ``permute``)."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise GgufError(f"{rows} rows in {heads} heads of pairs")
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def tensor(f: GgufFile, name: str) -> np.ndarray:
    """A tensor of ``f`` dequantized to float32, in numpy's order (``TensorInfo.shape``)."""
    info = f.tensors[name]
    return dequantize(f.raw(name), info.type).reshape(info.shape)


def dequantize(raw: bytes, ttype: TensorType) -> np.ndarray:
    """Elements of ``ttype`` stored in ``raw``, as a flat float32 array."""
    data = np.frombuffer(raw, dtype=np.uint8)
    if ttype == TensorType.F32:
        return data.view("<f4").copy()
    if ttype == TensorType.F16:
        return data.view("<f2").astype(np.float32)
    if ttype == TensorType.BF16:
        # bf16 is float32's upper half.
        return (data.view("<u2").astype(np.uint32) << 16).view(np.float32)
    blocks = data.reshape(-1, BLOCKS[ttype][1])
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    if ttype == TensorType.Q8_0:
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        return (q * d).reshape(-1)
    # Q4_0 and Q4_1: 16 bytes of 4-bit values, the low nibbles the block's first 16
    # elements, the high ones its last 16.
    packed = blocks[:, -16:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
    if ttype == TensorType.Q4_0:
        return ((q - 8) * d).reshape(-1)
    m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
    return (d * q + m).reshape(-1)


def hf_tensor(f: GgufFile, name: str, config: dict[str, Any]) -> np.ndarray:
    """The GGUF tensor ``name`` as HF's checkpoint holds it (float32): dequantized, in
    HF's dimension order, q and k rows in HF's rotary layout."""
    weight = tensor(f, name)
    if ".attn_q." in name:
        return unpermute(weight, config["num_attention_heads"])
    if ".attn_k." in name:
        return unpermute(weight, config["num_key_value_heads"])
    return weight


def hf_names(f: GgufFile) -> dict[str, str]:
    """HF's name -> the GGUF tensor holding it, for every tensor of ``f``."""
    names: dict[str, str] = {}
    for info in f:
        names[hf_name(info.name)] = info.name
    return names


def load_config(path: Path) -> ModelConfig:
    """The ``ModelConfig`` of the GGUF file at ``path`` (its header's); StartupError for
    a file this engine does not read."""
    try:
        with open_gguf(path) as f:
            return ModelConfig.from_dict(hf_config(f), str(path))
    except (GgufError, OSError) as exc:
        raise StartupError(f"cannot read {path}: {exc}") from None


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """What ``weights.Params.load`` reads of a checkpoint's tensor: float32, HF's shape."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "F32"


class GgufCheckpoint:
    """A llama GGUF file with ``checkpoint.Checkpoint``'s face for ``Params.load``: HF's
    names and shapes, checked against the config's weight table, each tensor handed out
    as float32 bytes in HF's layout (dequantized as it is asked for)."""

    def __init__(self, path: Path, config: dict[str, Any], names: dict[str, str],
                 tensors: dict[str, GgufTensor]) -> None:
        self.path = path
        self.tensors = tensors
        self._config = config
        self._names = names
        self._file: GgufFile | None = None

    @classmethod
    def scan(cls, path: Path, config: ModelConfig) -> GgufCheckpoint:
        """Read the header, and check its tensors against ``config``'s table."""
        try:
            with open_gguf(path) as f:
                names = hf_names(f)
                hf = hf_config(f)
                found = {name: f.tensors[gguf].shape for name, gguf in names.items()}
        except (GgufError, OSError) as exc:
            raise StartupError(f"cannot read {path}: {exc}") from None
        check_tensors(str(path), found, config)
        tensors = {name: GgufTensor(name, shape) for name, shape in expected_shapes(config).items()}
        return cls(path, hf, names, tensors)

    def __enter__(self) -> GgufCheckpoint:
        try:
            self._file = open_gguf(self.path)
        except (GgufError, OSError) as exc:
            raise StartupError(f"cannot read {self.path}: {exc}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def data(self, name: str) -> memoryview:
        """``name``'s float32 bytes in HF's layout (a copy: dequantized here)."""
        if self._file is None:
            raise RuntimeError("the GGUF checkpoint is not open")
        array = np.ascontiguousarray(hf_tensor(self._file, self._names[name], self._config))
        return array.data.cast("B")
