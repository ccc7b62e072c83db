"""The host-driven engine in the test process, on the peer's weights: what an answer
through the daemon must equal, token for token (torch: GPU tests only)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.model.options import EngineOptions, RunnerOptions
from dpu_frontend.model.runner import ModelRunner
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.tokenizer import Vocabulary


@contextmanager
def offline_engine(seed: int, *, max_seqs: int, max_model_len: int,
                   num_blocks: int) -> Iterator[ModelEngine]:
    """Qwen3-0.6B's shapes with ``seed``'s random weights, a KV cache of its own beside
    the peer's; its memory is given back at exit."""
    config = ModelConfig.default()
    vocab = Vocabulary.load(default_tokenizer_dir())
    runner = ModelRunner(config, RunnerOptions(weight_seed=seed, num_blocks=num_blocks,
                                               max_seqs=max_seqs, max_model_len=max_model_len,
                                               vocab_limit=vocab.tokenizer.get_vocab_size()))
    runner.load()
    yield ModelEngine(config, runner, EngineOptions())
    del runner
    torch.cuda.empty_cache()
