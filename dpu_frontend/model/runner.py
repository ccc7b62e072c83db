"""The one object that owns the GPU: weights, KV cache, per-slot token buffers.

``step`` runs one scheduled batch: it gathers the batch's input tokens from
the device-side token buffer (prompts and every sampled token live there, so
token values never travel through the host between steps), runs the model,
samples the sequences due to sample, and writes the drawn tokens back into
the buffer. The host builds only the batch's metadata: positions, cache
slots, block tables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from dpu_frontend.errors import StartupError
from dpu_frontend.model import registry
from dpu_frontend.model.automata import PoolEntry
from dpu_frontend.model.checkpoint import Checkpoint
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.gguf_checkpoint import GgufCheckpoint
from dpu_frontend.model.graphs import StepGraphs
from dpu_frontend.model.layers.attention import ATTN_ROWS, Attention, KvCache
from dpu_frontend.model.layers.constrain import DeviceAutomata
from dpu_frontend.model.layers.quant import FP8
from dpu_frontend.model.layers.sampler import Drawn, Sampler, SlotTokens, batch_params, to_device
from dpu_frontend.model.metadata import SlotParams, StepInputs, step_inputs
from dpu_frontend.model.models.base import Decoder
from dpu_frontend.model.options import RunnerOptions
from dpu_frontend.model.scheduler import Batch, Sequence
from dpu_frontend.model.weights import Params

log = logging.getLogger("dpu_frontend.model")

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ModelRunner:
    def __init__(self, config: ModelConfig, options: RunnerOptions) -> None:
        self.config = config
        self.options = options
        self.dtype = TORCH_DTYPES[options.dtype]
        self.device = torch.device("cuda", options.device)
        self.num_blocks = 0

    def load(self, *, keep_graphs: bool = False, reserve: int = 0) -> None:
        """Weights, KV cache, step graphs. ``keep_graphs``: keep each graph's
        cudaGraph_t (the GPU scheduler instantiates them for device launch);
        ``reserve``: bytes more to leave free of the KV cache (its sampler graphs)."""
        c, o = self.config, self.options
        torch.cuda.set_device(self.device)
        table = registry.spec(c.architecture).weights
        if (o.fp8_weights or o.fp8_kv) and (
                torch.version.hip is not None
                or torch.cuda.get_device_capability(self.device)[0] != 9):
            raise StartupError("FP8 weights and KV cache run on NVIDIA Hopper GPUs (compute "
                               "capability 9.x): the only ones their tiles and bits were "
                               "measured on (the FP8 linears' batch invariance rests on "
                               "Hopper's warpgroup MMA)")
        if o.fp8_weights and c.moe is not None:
            raise StartupError("--quantization fp8 is not implemented for a mixture of experts "
                               f"({c.architecture}): its experts' grouped products run in --dtype")
        if o.weights is None:
            params = Params.random(table, c, self.dtype, self.device, o.weight_seed,
                                   fp8=o.fp8_weights)
        else:
            # A GGUF file (llama.cpp's), or an HF checkpoint directory of safetensors.
            source = (GgufCheckpoint.scan(o.weights, c) if o.weights.suffix == ".gguf"
                      else Checkpoint.scan(o.weights, c))
            with source as checkpoint:
                params = Params.load(table, checkpoint, c, self.dtype, self.device,
                                     fp8=o.fp8_weights)
        # Before the KV cache takes what is left: structured output's pool and buffers.
        self.automata = DeviceAutomata(o.automaton_pool_bytes // 4, o.max_seqs + 1,
                                       o.max_seqs + 1, c.vocab_size, self.device)
        self.num_blocks = o.num_blocks or self._blocks_that_fit(reserve)
        cache = self._kv_cache()
        self.model: Decoder = registry.decoder_class(c.architecture)(c, params, cache, o.max_model_len)
        self.sampler = Sampler(o.vocab_limit)
        self.slot_params = SlotParams(o.max_seqs, c.vocab_size)
        # One row more than the slots: the GPU scheduler's padding rows draw into it.
        rows = o.max_seqs + 1
        self.slots = SlotTokens(
            tokens=torch.zeros((rows, o.max_model_len), dtype=torch.int64, device=self.device),
            counts=torch.zeros((rows, c.vocab_size), dtype=torch.int32, device=self.device),
            in_prompt=torch.zeros((rows, c.vocab_size), dtype=torch.bool, device=self.device))
        self.graphs: StepGraphs | None = None
        #: Steps by how they ran: replayed from a decode or a mixed graph, or eager.
        self.steps = {"decode graph": 0, "mixed graph": 0, "eager": 0}
        if o.cuda_graphs:
            self.graphs = StepGraphs(self.model, self.slots.tokens, o.max_seqs,
                                       -(-o.max_model_len // o.block_size),
                                       scratch_slot=self.num_blocks * o.block_size,
                                       keep_graphs=keep_graphs)
            self.graphs.capture()
        kv_bytes = self.num_blocks * o.block_size * self._kv_bytes_per_token()
        log.info("model loaded: %s, %d layers, %s%s, %d KV blocks of %d tokens, %s "
                 "(%.1f GiB)", c.architecture, c.num_layers, o.dtype,
                 ", FP8 linear weights" if o.fp8_weights else "", self.num_blocks,
                 o.block_size, "FP8" if o.fp8_kv else o.dtype, kv_bytes / 2**30)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under HF's names (the tests hand them to ``transformers``)."""
        table = registry.spec(self.config.architecture).weights
        return self.model.params.state_dict(table, self.config)

    def _kv_cache(self) -> KvCache:
        c, o = self.config, self.options
        # One block more than the pool hands out: the scratch block where the padding
        # rows of a decode graph write their K and V.
        shape = (c.num_layers, self.num_blocks + 1, c.num_kv_heads, o.block_size, c.head_dim)
        dtype = FP8 if o.fp8_kv else self.dtype
        k, v = (torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2))
        if not o.fp8_kv:
            return KvCache(k, v)
        # A scale per token and head; zero K and V over a scale of 1 until written.
        scales = [torch.ones(shape[:4], dtype=torch.float32, device=self.device)
                  for _ in range(2)]
        return KvCache(k, v, *scales)

    def _kv_bytes_per_token(self) -> int:
        if self.options.fp8_kv:
            return self.config.kv_bytes_per_token(1, scale_bytes=4)
        return self.config.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8)

    def _blocks_that_fit(self, extra: int) -> int:
        o = self.options
        # What the load's temporaries left in torch's cache (the weights drawn or quantized
        # in float32) is free for the KV cache too.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # What the step's activations and the sampler's [batch, vocab] buffers take.
        reserve = (4 << 30) + extra
        budget = free - (1 - o.memory_fraction) * total - reserve
        per_block = self._kv_bytes_per_token() * o.block_size
        blocks = int(budget // per_block)
        if blocks * o.block_size < o.max_model_len:
            raise StartupError(f"the GPU has room for {blocks} KV blocks, fewer than one "
                             f"{o.max_model_len}-token context needs")
        return blocks

    def load_prompt(self, seq: Sequence, prompt: list[int],
                    automaton: PoolEntry | None = None) -> None:
        """A newly admitted sequence's prompt into its slot (and the penalties' state),
        and the automaton it walks, if it is constrained."""
        ids = to_device(torch.tensor(prompt, dtype=torch.int64), self.device)
        state = self.slots
        state.tokens[seq.slot, :len(prompt)] = ids
        state.counts[seq.slot].zero_()
        state.in_prompt[seq.slot].zero_()
        # index_fill_, not ``[slot, ids] = True``: that indexed store made its value a
        # tensor with a copy that waited for the stream (an overlapped step's whole graph).
        state.in_prompt[seq.slot].index_fill_(0, ids, True)
        self.slot_params.set(seq.slot, seq.params, seq.seed, constrained=automaton is not None)
        self.automata.attach(seq.slot, automaton)

    def step(self, batch: Batch, top_logprobs: int = -1,
             publish: Callable[[Drawn], None] | None = None) -> Drawn | None:
        """Run ``batch``; the drawn tokens of its sampling works, in work order.
        ``top_logprobs`` >= 0 also computes log probabilities (and that many
        alternatives). ``publish`` queues work behind the sampler that reads the
        tokens on the GPU (the record writer), before their copy home."""
        if not batch.works:
            return None
        samplers = [w.seq for w in batch.works if w.sample]
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        inputs = self._inputs(batch)
        graphs = self.graphs
        graph = graphs.graph_for(inputs) if graphs is not None else None
        if graphs is not None and graph is not None:
            self.steps["decode graph" if graph.samples is None else "mixed graph"] += 1
            logits = graphs.run(graph, inputs)
        else:
            self.steps["eager"] += 1
            attn, input_ids, sample_rows = self._eager(inputs)
            hidden = self.model.forward(input_ids, attn)
            logits = self.model.logits(hidden[sample_rows])
        if not samplers:
            return None
        n = len(samplers)
        rows = np.fromiter((x for s in samplers for x in (s.slot, s.generated, s.prompt_len)),
                           np.int64, 3 * n).reshape(n, 3).T
        params = batch_params(self.slot_params.rows(rows[0], rows[1]), self.device)
        # Each row's slot, and where its token goes there (the position after its last).
        where = to_device(torch.from_numpy(np.stack([rows[0], rows[1] + rows[2]])), self.device)
        drawn = self.sampler.step(logits, params, where[0], where[1], self.slots, top_logprobs,
                                  self.automata)
        if publish is not None:
            publish(drawn)
        drawn.send_home(start)
        return drawn

    def _inputs(self, batch: Batch) -> StepInputs:
        return step_inputs(batch, self.options.block_size, ATTN_ROWS // self.config.group_size)

    def _eager(self, step: StepInputs) -> tuple[Attention, torch.Tensor, torch.Tensor]:
        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device)

        attn = Attention.of({name: dev(getattr(step, name)) for name in Attention.inputs()},
                            prompts=not step.decode)
        return attn, self.slots.tokens[dev(step.slots), attn.positions], dev(step.sample_rows)
