"""The model benchmarks' arithmetic, without torch: a model config's bandwidth bounds,
and the model peer's engine counters read as the same figures whichever scheduler ran.

``benchmarks.model_step`` and ``benchmarks.model_serving`` take ``--model-config``
(an HF ``config.json``; ``benchmarks/configs`` holds Qwen3-8B's and Qwen3-32B's)
and compute every bound here from it: the weights read once a step, and the K and V
of every position a step's attention reads. The peer's counters come in two shapes
(``peer_report(address)["kernel"]``): the host engine's (``EngineStats`` and the
loop's ``engine_s``/``loop_s``, ``dpu_frontend/model/source.py``) and the GPU
scheduler's (``{"scheduler": "gpu"}`` and ``dpuf_model_stats``,
``dpu_frontend/model/gpu_scheduler.py``). ``engine_figures`` maps both onto the
same steps, tokens, GPU time and bound; only the host's work per step differs in
kind (the host's launch, wait and judge against the scheduler kernel's own pass).
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpu_frontend.model.config import ModelConfig
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.tokenizer import Vocabulary

#: Bytes of a weight and of a K or V element in the bounds of the served model: bf16,
#: the model peer's default ``--dtype``.
SERVED_ELEMENT = 2
#: An FP8 element, and the float32 scale beside each FP8 row, channel or cached head.
FP8_ELEMENT, SCALE_BYTES = 1, 4
#: model-peer flags ``model_serving`` sets from its own options, never through
#: ``--peer-arg``: the bounds are computed from the config and the precision the peer runs.
OWN_PEER_FLAGS = ("--model-config", "--scheduler", "--quantization", "--kv-cache-dtype",
                  "--tokenizer")
#: Prompts are token ids drawn from here up to the tokenizer's size (past the ids of
#: bytes and the commonest pieces), none of them a special token.
PROMPT_ID_LOW, PROMPT_ID_HIGH = 100, 150_000


@dataclass(frozen=True, slots=True)
class Precision:
    """How the model peer stores what a step reads: the model dtype's element size,
    FP8 linear weights (``--quantization fp8``: a float32 scale per output channel), an
    FP8 KV cache (``--kv-cache-dtype fp8``: a float32 scale per token and head)."""

    element: int = SERVED_ELEMENT
    fp8_weights: bool = False
    fp8_kv: bool = False

    @classmethod
    def of_flags(cls, quantization: str = "none", kv_cache_dtype: str = "auto",
                 element: int = SERVED_ELEMENT) -> Precision:
        return cls(element, quantization == "fp8", kv_cache_dtype == "fp8")

    def flags(self) -> list[str]:
        """The model peer's flags for this precision (none for the defaults)."""
        return ((["--quantization", "fp8"] if self.fp8_weights else [])
                + (["--kv-cache-dtype", "fp8"] if self.fp8_kv else []))

    def describe(self) -> str:
        return (f"{'FP8' if self.fp8_weights else 'model-dtype'} linear weights, "
                f"{'FP8' if self.fp8_kv else 'model-dtype'} KV cache")

    def weight_bytes(self, config: ModelConfig, batch: float | None = None,
                     experts: float | None = None) -> int:
        """``weight_bytes_read``: with FP8 weights, the layers' linear weights at a byte
        an element and their channels' scales; the rest in the model dtype."""
        total = weight_bytes_read(config, self.element, batch, experts)
        if self.fp8_weights:
            elements, channels = config.linear_weights()
            total += elements * (FP8_ELEMENT - self.element) + channels * SCALE_BYTES
        return total

    def kv_bytes_per_token(self, config: ModelConfig) -> int:
        if self.fp8_kv:
            return config.kv_bytes_per_token(FP8_ELEMENT, SCALE_BYTES)
        return config.kv_bytes_per_token(self.element)


def add_served_model_arguments(ap: argparse.ArgumentParser) -> None:
    """``--model-config`` and ``--tokenizer`` of a benchmark that starts a model peer and
    a daemon (``model_serving``, ``blink``)."""
    ap.add_argument("--model-config", type=Path, metavar="FILE",
                    help="the model's config.json (or a directory with one), handed to the "
                         "model peer; the bounds are its (default: Qwen3-0.6B's shapes)")
    ap.add_argument("--tokenizer", type=Path, metavar="DIR",
                    help="the daemon's and the peer's tokenizer (default: the bundled Qwen3 "
                         "one); prompts are token ids below its size")


def load_config(path: Path | None) -> tuple[ModelConfig, str]:
    """The config ``--model-config`` names (a config.json or a directory with one),
    else Qwen3-0.6B's shapes, which the model peer uses without the flag; and where it
    came from, for the figures."""
    if path is None:
        return ModelConfig.default(), "the built-in Qwen3-0.6B shapes"
    return ModelConfig.load(path), str(path)


def own_peer_flags(model_config: Path | None, scheduler: str, extra: Sequence[str],
                   precision: Precision = Precision()) -> list[str]:
    """The model peer's ``--scheduler``, ``--model-config`` (made absolute: the peer
    runs in a directory of its own) and precision flags. ValueError if ``extra``
    (``--peer-arg``) sets any of them: the peer would run one config and the bounds be
    another's."""
    for flag in extra:
        name = flag.split("=", 1)[0]
        # argparse takes an unambiguous prefix for the whole flag: refuse those too.
        owns = [own for own in OWN_PEER_FLAGS if len(name) > 2 and own.startswith(name)]
        if owns:
            raise ValueError(f"--peer-arg={flag}: pass {owns[0]} to the benchmark, which hands "
                             f"it to the model peer and computes the bounds from it")
    flags = ["--scheduler", scheduler, *precision.flags()]
    if model_config is not None:
        flags += ["--model-config", str(model_config.resolve())]
    return flags


@dataclass(frozen=True, slots=True)
class BenchTokenizer:
    """The tokenizer a model benchmark hands to the daemon and the model peer
    (``--tokenizer``; the bundled Qwen3 one without it), and the token ids its prompts
    are drawn from: the prompts are token ids, which the completions API takes, so any
    tokenizer no larger than the model's vocabulary serves (Phi-4's installs from no
    package: GPT-2's stands in, and the figures say so)."""

    path: Path | None
    size: int
    name: str
    #: Its special tokens' ids (end of turn, ...), which no prompt holds.
    special: frozenset[int] = frozenset()

    @classmethod
    def load(cls, path: Path | None, config: ModelConfig) -> BenchTokenizer:
        """ValueError where the tokenizer has more ids than the model's vocabulary (the
        peer would refuse to start)."""
        vocab = Vocabulary.load(path or default_tokenizer_dir())
        size = vocab.tokenizer.get_vocab_size()
        if size > config.vocab_size:
            raise ValueError(
                f"the tokenizer {path or 'bundled (Qwen3)'} has {size} ids, the model "
                f"{config.vocab_size}: pass --tokenizer (Llama-3: build/assets/llama3_1; "
                "a model whose tokenizer installs from no package: a smaller one, such as "
                "GPT-2's build/assets/gpt2)")
        special = frozenset(i for i, t in vocab.tokenizer.get_added_tokens_decoder().items()
                            if t.special)
        return cls(path, size, str(path) if path else "the bundled Qwen3 tokenizer", special)

    def flags(self) -> list[str]:
        """``--tokenizer`` for the daemon and the peer, absolute (the peer runs elsewhere)."""
        return ["--tokenizer", str(self.path.resolve())] if self.path else []

    def prompt_ids(self, rng: random.Random, length: int) -> list[int]:
        high = min(PROMPT_ID_HIGH, self.size)
        ids: list[int] = []
        while len(ids) < length:
            token = rng.randrange(PROMPT_ID_LOW, high)
            if token not in self.special:
                ids.append(token)
        return ids


def describe(config: ModelConfig) -> str:
    """The shapes that make the bounds, in one line."""
    c = config
    head = "tied" if c.tie_word_embeddings else "untied"
    return (f"{c.architecture}: {c.num_layers} layers, hidden {c.hidden_size}, intermediate "
            f"{c.intermediate_size}, {c.num_heads} query and {c.num_kv_heads} KV heads of "
            f"{c.head_dim}, vocabulary {c.vocab_size}, {head} LM head; "
            f"{c.parameter_count() / 1e9:.2f}B parameters")


def experts_read(config: ModelConfig, batch: float | None) -> float:
    """The experts a MoE layer reads in a decode step of ``batch`` tokens: each token
    routes to k of E, so E (1 - (1 - k/E)^batch) are expected if routing were uniform
    (a real router's favourites make it fewer: the bound is then a little low). Every
    expert where ``batch`` is None."""
    moe = config.moe
    if moe is None:
        return 0.0
    if batch is None:
        return float(moe.num_experts)
    e, k = moe.num_experts, moe.top_k
    return max(float(min(k, e)) if batch > 0 else 0.0, e * (1 - math.pow(1 - k / e, batch)))


def weight_bytes_read(config: ModelConfig, element: int = SERVED_ELEMENT,
                      batch: float | None = None, experts: float | None = None) -> int:
    """The weights' bytes a decode step of ``batch`` sequences reads: every parameter,
    but of an untied input embedding only the step's own rows (a few KB, left out): the
    output head is read whole, the embedding table is not. A tied model's one table is
    the head. Of a mixture of experts, the experts the batch routes to
    (``experts_read``); all of them where ``batch`` is None."""
    parameters = config.parameter_count()
    if not config.tie_word_embeddings:
        parameters -= config.vocab_size * config.hidden_size
    if config.moe is not None:
        per_expert = 3 * config.moe.intermediate * config.hidden_size  # gate, up, down
        read = experts_read(config, batch) if experts is None else experts
        unread = config.moe.num_experts - read
        parameters -= round(config.num_layers * unread * per_expert)
    return parameters * element


def step_bytes(config: ModelConfig, batch: int, context: int, precision: Precision,
               experts: float | None = None) -> tuple[int, int]:
    """A decode step's bytes read, (weights, K and V), with ``batch`` sequences each
    attending ``context`` positions, stored as ``precision`` says; ``experts``: a
    mixture's experts read a layer, where counted."""
    return (precision.weight_bytes(config, batch, experts),
            batch * context * precision.kv_bytes_per_token(config))


def kv_blocks(batch: int, positions: int, block_size: int) -> int:
    """KV cache blocks that ``batch`` sequences of ``positions`` tokens each hold."""
    return batch * -(-positions // block_size)


def bound_tokens_per_s(config: ModelConfig, pairs: list[tuple[int, int]], batch: int,
                       bandwidth: float, precision: Precision = Precision()) -> float:
    """Decode tokens/s the copy bandwidth allows with ``batch`` sequences running, at the
    mix's mean context per generated token (a sequence's k-th token reads p + k)."""
    generated = sum(o for _, o in pairs)
    context = sum(o * (p + o / 2) for p, o in pairs) / generated
    step = (precision.weight_bytes(config, batch)
            + batch * context * precision.kv_bytes_per_token(config))
    return batch / (step / bandwidth)


def own_bound_tokens_per_s(config: ModelConfig, steps: float, context_tokens: float,
                           tokens: float, bandwidth: float,
                           precision: Precision = Precision(), rows: float | None = None) -> float:
    """Output tokens/s the copy bandwidth allows for the steps a run actually took:
    the weights once a step (``weight_bytes_read``), and the K and V of every position
    each step attended (the engine's ``context_tokens``), at their batch sizes, tail and
    ramp included. A mixture of experts' weights at the run's mean rows a step
    (``rows``, prompt rows included: they route too; else ``tokens``): an approximation.
    Where the steps' sizes spread (a ramp, a tail), the mean's experts are more than the
    steps' mean experts (the count is concave in the batch), so this bound is low."""
    mean_batch = (rows if rows is not None else tokens) / steps if steps else None
    seconds = (steps * precision.weight_bytes(config, mean_batch)
               + context_tokens * precision.kv_bytes_per_token(config)) / bandwidth
    return tokens / seconds if seconds else 0.0


def counter_deltas(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, float]:
    """``after - before`` of every numeric counter; what is not a number (the GPU
    scheduler's ``"scheduler": "gpu"``) is no counter. A key the first reading lacks
    counts from 0."""
    def number(v: object) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    return {k: v - (before[k] if number(before.get(k)) else 0)
            for k, v in after.items() if number(v)}


@dataclass(frozen=True, slots=True)
class Steps:
    """A run's engine steps, as either scheduler counts them."""

    steps: float
    sampled: float  # tokens drawn: the output
    scheduled: float  # prompt and decode tokens through the model
    #: KV positions the steps' attention read; None where the peer does not count them.
    context: float | None
    gpu_s: float  # the steps' GPU time

    @classmethod
    def of_host(cls, d: Mapping[str, float]) -> Steps:
        """The host engine's ``EngineStats``: ``tokens`` are the drawn ones."""
        return cls(d["steps"], d["tokens"], d["scheduled_tokens"], d.get("context_tokens"),
                   d["gpu_s"])

    @classmethod
    def of_gpu(cls, d: Mapping[str, float]) -> Steps:
        """The GPU scheduler's ``dpuf_model_stats``: ``tokens`` are the rows through the
        model, ``sampled`` the drawn ones; ``ns_step``, a launch to the next pass's
        start (forward, sampler and the launches between them)."""
        return cls(d["steps"], d["sampled"], d["tokens"], d.get("context_tokens"),
                   d["ns_step"] / 1e9)


def is_gpu(counters: Mapping[str, Any]) -> bool:
    """Whether a ``kernel`` report is the GPU scheduler's."""
    return counters.get("scheduler") == "gpu"


def run_bound(config: ModelConfig, before: Mapping[str, Any], after: Mapping[str, Any],
              bandwidth: float, precision: Precision = Precision()) -> float:
    """The output tokens/s bound of the steps between two readings of the peer's
    ``kernel`` counters (``own_bound_tokens_per_s``), either scheduler; 0 where the
    peer does not count the context its steps read."""
    d = counter_deltas(before, after)
    run = Steps.of_gpu(d) if is_gpu(after) else Steps.of_host(d)
    if run.context is None:
        return 0.0
    return own_bound_tokens_per_s(config, run.steps, run.context, run.sampled, bandwidth,
                                  precision, rows=run.scheduled)


def engine_figures(name: str, config: ModelConfig, before: Mapping[str, Any],
                   after: Mapping[str, Any], output_tokens_per_s: float,
                   bandwidth: float, precision: Precision = Precision()) -> dict[str, object]:
    """Where the peer's time went during a run, per engine step, from two readings of
    its ``kernel`` counters. The same figures for both schedulers: steps and their mean
    tokens, the steps' GPU time, and beside the output rate the bound of the run's own
    steps. Then the host's work per step in its kind: the host engine's (launch:
    schedule, inputs, graph replay; wait for the GPU's tokens; judge: stop rules) and
    the loop between two steps (the records in and out), or the scheduler kernel's pass
    (publish and retire, mailbox and intake, schedule, prepare and launch) and its
    idle passes."""
    gpu = is_gpu(after)
    d = counter_deltas(before, after)
    run = Steps.of_gpu(d) if gpu else Steps.of_host(d)
    steps = run.steps or 1
    figures: dict[str, object] = {
        f"{name}: engine steps, mean sampled / scheduled tokens":
            f"{run.steps:.0f}, {run.sampled / steps:.0f} / {run.scheduled / steps:.0f}",
    }
    if "sum_running" in d:  # peers before these counters lack them
        figures[f"{name}: per step, mean running / waiting sequences"] = (
            f"{d['sum_running'] / steps:.0f} / {d['sum_waiting'] / steps:.0f}")
    if gpu:
        ms = {k: round(d[f"ns_{k}"] / 1e6 / steps, 3)
              for k in ("publish", "intake", "schedule", "prepare")}
        figures[f"{name}: per step, ms: GPU scheduler's pass (publish + intake + schedule + "
                f"prepare)"] = (f"{round(sum(ms.values()), 3)} ({ms['publish']} + "
                                f"{ms['intake']} + {ms['schedule']} + {ms['prepare']})")
        figures[f"{name}: GPU scheduler idle (passes with nothing to run), s"] = round(
            d["ns_idle"] / 1e9, 3)
        if "ns_idle_waiting" in d:
            figures[f"{name}: of which with sequences waiting (none could run), s"] = round(
                d["ns_idle_waiting"] / 1e9, 3)
    else:
        per = {k: round(d[k] / steps * 1e3, 2)
               for k in ("engine_s", "launch_s", "wait_s", "judge_s", "loop_s")}
        figures[f"{name}: per step, ms: engine (launch + wait for tokens + judge) / loop "
                f"between steps"] = (f"{per['engine_s']} ({per['launch_s']} + {per['wait_s']} + "
                                     f"{per['judge_s']}) / {per['loop_s']}")
    figures[f"{name}: per step, ms: GPU time"] = round(run.gpu_s / steps * 1e3, 2)
    own = run_bound(config, before, after, bandwidth, precision)
    figures[f"{name}: bound of the run's own steps (weights + KV read each step), output "
            f"tokens/s"] = (f"{own:.0f} (the output rate is {output_tokens_per_s / own:.2f} "
                            f"of it)" if own else "-")
    return figures
