"""Text in, text out: tokenize, submit to the GPU peer, detokenize as records arrive.

The HTTP layer speaks requests and SSE; this module speaks token ids and text
deltas. Tokenization runs on a few threads, off the event loop (a 256K-token
prompt takes a while), all with the one tokenizer the detokenizers use:
``encode_batch`` and ``DecodeStream.step`` borrow it shared (nothing here calls
a method that changes it), and ``encode_batch`` releases the GIL while it works.
A copy a thread cost 86 MB each (the Qwen3 vocabulary).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from dpu_frontend.config import ServeConfig
from dpu_frontend.engine.pool import PeerPool
from dpu_frontend.engine.request import RingRequest
from dpu_frontend.errors import PeerError, PromptTooLong, RequestError
from dpu_frontend.metrics import Metrics
from dpu_frontend.ring import FinishReason, ResponseRecord, SamplingParams
from dpu_frontend.ring.automaton import Constraint
from dpu_frontend.text.chat_template import ChatTemplate
from dpu_frontend.text.constraints import CompilerProcess, ConstraintError, ConstraintSpec
from dpu_frontend.text.detokenizer import IncrementalDetokenizer
from dpu_frontend.text.stop import StopMatcher
from dpu_frontend.text.token_bytes import TokenBytes
from dpu_frontend.text.tokenizer import COUNT_CHUNK_CHARS, Vocabulary, count_beyond, encode

log = logging.getLogger("dpu_frontend.engine")

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token with its log probability, for a request that asked."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the alternatives asked for, most likely first
    offset: int  # characters of the completion's text before this token's


@dataclass(slots=True)
class Delta:
    """New text of one sequence (choice ``index`` of its request); the last one carries
    the finish reason."""

    index: int
    text: str
    finish_reason: str | None
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens of this delta, when asked for
    #: When the daemon received the oldest record of its batch (time.monotonic(); 0:
    #: not known), for the delivery latency.
    received: float = 0.0


class DeltaSink(Protocol):
    """Takes a generation's deltas in the poll loop, as their records arrive
    (``Generation.attach``): an HTTP stream's writer."""

    def ready(self) -> bool:
        """Whether it can take a delta now, without waiting (its connection's buffer is
        empty)."""

    def take(self, delta: Delta) -> None:
        """Send ``delta`` on; it must not wait."""


@dataclass(frozen=True, slots=True)
class TextOptions:
    """What the daemon itself applies to the generated text."""

    stop: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special_tokens: bool = True


class Service:
    def __init__(self, config: ServeConfig, vocab: Vocabulary, pool: PeerPool,
                 chat_template: ChatTemplate | None, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.vocab = vocab
        self.pool = pool
        self.chat_template = chat_template
        self.max_model_len = config.max_model_len or vocab.model_max_length
        self._executor = ThreadPoolExecutor(max_workers=config.tokenizer_threads,
                                            thread_name_prefix="tokenize")
        self._token_bytes: TokenBytes | None = None
        self._tokenizer = vocab.tokenizer  # shared by the tokenizer threads
        # Structured output's compiler, started by warm_up or on first use (a process
        # of its own, each compile bounded in time), waited on from a thread of its
        # own: a schema's seconds of compiling never hold up tokenization. One compile per constraint
        # at a time: requests that bring it meanwhile wait for that one.
        self._compile_executor = ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="constraints")
        self._compiler: CompilerProcess | None = None
        self._compiling: dict[str, asyncio.Future[bytes]] = {}

    @property
    def token_bytes(self) -> TokenBytes:
        """Token ids as text and bytes, for log probabilities (built by ``warm_up``, or
        at first use)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.vocab.tokenizer)
        return self._token_bytes

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return encode(self._tokenizer, text, add_special_tokens=add_special_tokens)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU-heavy request work (a huge decode, a template render) on the tokenizer
        threads: a stalled event loop would also stall the RDMA deadlines."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def detokenize(self, ids: list[int]) -> str:
        return await self.off_loop(lambda: str(self._tokenizer.decode(ids)))

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        """Token ids a client sent must exist in the vocabulary the GPU side uses."""
        size = self.vocab.tokenizer.get_vocab_size()
        if ids and max(ids) >= size:
            raise RequestError(f"token id {max(ids)} is outside the vocabulary ({size} ids)",
                               param=param)

    async def warm_up(self) -> None:
        """Start every tokenizer thread now, with an encode each, and build the
        token-bytes table of log probabilities, rather than on the first requests."""
        threads = self.config.tokenizer_threads
        barrier = threading.Barrier(threads)

        def start() -> None:
            self._encode("warm up", True)
            barrier.wait(timeout=60)  # hold this thread so that each one starts

        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._executor, start)
                               for _ in range(threads)))
        _ = self.token_bytes  # built now rather than on the first request
        if self.config.constraint_compiler_at_start and self.vocab.eos_token_ids:
            # Made here, on the loop's thread as every use is; started on the compiler's
            # thread and not awaited: the worker serves meanwhile, and a first compile
            # queues behind the start.
            self._compile_executor.submit(self._start_compiler, self.compiler)

    @property
    def compiler(self) -> CompilerProcess:
        """Structured output's compiler (its process starts at ``warm_up`` or at the
        first compile). Made on the event loop's thread only."""
        if self._compiler is None:
            cfg = self.config
            self._compiler = CompilerProcess(
                self.vocab.source, self.vocab.eos_token_ids[0],
                vocab_size=self.vocab.tokenizer.get_vocab_size(),
                max_entries=cfg.constraint_cache_entries,
                max_cached_bytes=cfg.constraint_cache_bytes,
                max_automaton_bytes=cfg.max_automaton_bytes,
                timeout_s=cfg.constraint_compile_timeout_s)
        return self._compiler

    @staticmethod
    def _start_compiler(compiler: CompilerProcess) -> None:
        """The compiler's process started on its own thread, as a compile would; a
        failure is logged, and the first compile tries again."""
        try:
            compiler.start()
        except ConstraintError as exc:
            if compiler.closed:  # the worker stops: nothing to say
                log.debug("the constraint compiler's start ended by its close")
                return
            log.warning("the constraint compiler did not start ahead of use: %s", exc)
        except Exception:  # nobody awaits this: say it here
            log.exception("the constraint compiler failed to start ahead of use")

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        loop = asyncio.get_running_loop()
        with self.metrics.tokenize_time.time():
            return await loop.run_in_executor(self._executor, self._encode, text,
                                              add_special_tokens)

    async def tokenize_prompt(self, text: str, param: str, *,
                              add_special_tokens: bool = True) -> list[int]:
        """The ids of a prompt; for one that cannot fit the context, PromptTooLong
        (naming ``param``) after as little tokenizing as can tell."""
        most = self.vocab.max_token_chars
        if most is not None and len(text) > most * (self.max_model_len - 1):
            # No token stands for more than ``most`` characters: this many cannot fit.
            raise self._too_long(f"your prompt is {len(text)} characters long, at least "
                                 f"{-(-len(text) // most)} tokens of this vocabulary", param)
        loop = asyncio.get_running_loop()
        with self.metrics.tokenize_time.time():
            return await loop.run_in_executor(self._executor, self._encode_prompt, text,
                                              add_special_tokens, param)

    def _encode_prompt(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        # What one prompt may cost a tokenizer thread. One longer than max_model_len
        # characters and one chunk is counted a chunk at a time first, so that a
        # prompt too long for the context is refused after tokenizing about
        # max_model_len tokens and a chunk (a 20 MB prompt was tokenized whole, in
        # 14 to 58 s); one whose first chunk projects to at most twice the context
        # is tokenized whole after that chunk. Text that makes few tokens a character
        # (a run of spaces: 4 MiB of it is 32K tokens and takes seconds) or whose
        # density changes (spaces, then digits) is bounded by max_request_bytes only.
        if len(text) > max(self.max_model_len, COUNT_CHUNK_CHARS):
            counted = count_beyond(self._tokenizer, text, self.max_model_len - 1)
            if counted is not None:
                raise self._too_long(f"your prompt has at least {counted} tokens", param)
        return self._encode(text, add_special_tokens)

    def _too_long(self, detail: str, param: str) -> PromptTooLong:
        return PromptTooLong(f"This model's maximum context length is {self.max_model_len} "
                             f"tokens. However, {detail}.", param=param,
                             code="context_length_exceeded")

    def fit(self, prompt_tokens: int, max_tokens: int, prompt_param: str) -> int:
        """``max_tokens``, capped at the context the prompt leaves: a completion that reaches
        the end of the context ends there with finish_reason "length", as one that reaches
        ``max_tokens`` does. A prompt that leaves no room at all is refused, naming it."""
        if prompt_tokens >= self.max_model_len:
            raise self._too_long(
                f"your prompt has {prompt_tokens} tokens, which leaves no room for a "
                "completion", prompt_param)
        return min(max_tokens, self.max_model_len - prompt_tokens)

    def submit(self, prompt: list[int], params: SamplingParams,
               options: TextOptions = TextOptions(), index: int = 0,
               constraint: Constraint | None = None) -> Generation:
        """Queue the request for a GPU peer now: admission errors (429, 503) raise here,
        before any response byte is written."""
        # Everything that can fail comes first: once submitted, the GPU generates up to
        # max_tokens whether or not anyone holds the request to read or cancel it.
        detok = IncrementalDetokenizer(self.vocab, context=self.vocab.context(prompt),
                                       skip_special_tokens=options.skip_special_tokens)
        stops = StopMatcher(options.stop, include=options.include_stop)
        return Generation(self.pool.submit(prompt, params, constraint), detok, stops,
                          params.logprobs,
                          self.vocab.tokenizer.get_vocab_size(), index)

    async def constraint(self, spec: ConstraintSpec) -> Constraint:
        """``spec`` compiled for the ring (from the cache when it was seen): a 400 naming
        its field if no peer decodes structured output, or if it does not compile."""
        if not self.pool.offers_constraints:
            raise RequestError("the GPU peers do not decode structured output (no peer's "
                               "ring offers constraints)", param=spec.param,
                               code="unsupported_parameter")
        if not self.vocab.eos_token_ids:
            raise RequestError("the tokenizer names no end token to end a constrained "
                               "answer with", param=spec.param, code="unsupported_parameter")
        compiler = self.compiler
        key = spec.key(compiler.eos)
        future = self._compiling.get(key)
        if future is None:
            future = asyncio.get_running_loop().run_in_executor(
                self._compile_executor, compiler.encoded, spec)
            self._compiling[key] = future
            future.add_done_callback(lambda _: self._compiling.pop(key, None))
        started = time.monotonic()
        try:
            # Shielded: a client that goes away does not cancel a compile others wait for.
            encoded = await asyncio.shield(future)
        except ConstraintError as exc:
            self.metrics.constraint_time.labels(spec.param, "refused").observe(
                time.monotonic() - started)
            raise RequestError(str(exc), param=spec.param) from exc
        self.metrics.constraint_time.labels(spec.param, "ready").observe(
            time.monotonic() - started)
        return Constraint(encoded, spec.param)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._compile_executor.shutdown(wait=False, cancel_futures=True)
        if self._compiler is not None:
            self._compiler.close()


class Generation:
    """One submitted sequence, turned into text deltas as its records arrive."""

    def __init__(self, request: RingRequest, detok: IncrementalDetokenizer,
                 stops: StopMatcher, logprobs: int | None = None, vocab_size: int = 0,
                 index: int = 0) -> None:
        self.request = request  # nothing here may fail: the request is on its way
        self.index = index  # the choice it is of its request
        self._detok = detok
        self._stops = stops
        self._logprobs = logprobs  # alternatives asked for; None: no log probabilities
        self._vocab_size = vocab_size
        self._chars = 0  # characters detokenized so far (the next token's text offset)
        self._count = 0  # tokens received
        self._sink: DeltaSink | None = None
        self._broken: Exception | None = None  # raised in the poll loop, for the reader

    def cancel(self) -> None:
        self.request.cancel()  # a no-op once the final record was read

    def attach(self, sink: DeltaSink) -> bool:
        """Hand the deltas of this generation's records to ``sink`` in the poll loop as
        they arrive, instead of waking the reader of ``batches`` for each: the reader
        wakes for the last record, and for those that come while ``sink`` is not ready
        or while it is still busy with earlier ones (the order of records is kept).

        Only where a record makes at most one delta and only the last one ends the
        sequence: not with log probabilities, not with stop strings (a stop string
        ends it on any record). False for those: nothing is attached.
        """
        if self._logprobs is not None or self._stops.stops:
            return False
        self._sink = sink
        self.request.direct = self._direct
        return True

    def _direct(self, record: ResponseRecord, received: float) -> bool:
        sink = self._sink
        if record.finish or sink is None or self._broken is not None:
            return False
        try:
            if not sink.ready():
                return False
            delta = self.convert(record, received)
            if delta is not None:
                sink.take(delta)
        except Exception as exc:
            # Not the poll loop's to handle: the reader, woken for this record, raises it.
            self._broken = exc
            return False
        return True

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """Deltas of the generated text; their concatenation equals the full decode of
        the generated ids after the prompt, cut at the first stop string."""
        async with contextlib.aclosing(self.batches()) as batches:
            async for batch in batches:
                for delta in batch:
                    yield delta

    async def batches(self) -> AsyncGenerator[list[Delta], None]:
        """``deltas``, as many at a time as have come: each wake-up converts every
        record received by then (those of one poll, when the reader keeps up)."""
        request = self.request
        try:
            while await request.wait():
                if self._broken is not None:
                    # Raised once, and let go: it holds the poll loop's frames.
                    broken, self._broken = self._broken, None
                    raise broken
                batch: list[Delta] = []
                received = request.received_at
                for record in request.take():
                    try:
                        delta = self.convert(record, received)
                    except Exception:
                        if batch:
                            yield batch  # the deltas before the bad record go out first
                        raise
                    if delta is not None:
                        batch.append(delta)
                        if delta.finish_reason is not None:
                            break  # the last: what may follow it is not wanted
                if batch:
                    yield batch
                    if batch[-1].finish_reason is not None:
                        return
        finally:
            request.direct = self._sink = None
            self.cancel()

    def convert(self, record: ResponseRecord, received: float = 0.0) -> Delta | None:
        """The delta one record makes (None: no text yet); the one with a finish reason
        is the last. A stop string matched cancels the generation on the GPU side."""
        stops = self._stops
        self._count += len(record.tokens)
        lps: tuple[TokenLogprob, ...] = ()
        if self._logprobs is None:
            text = stops.feed(self._detok.push(record.tokens))
        else:
            pushed, lps = self._push_with_logprobs(record)
            text = stops.feed(pushed)
        final = record.finish != 0  # record.final, without the property call: per record
        if final:
            if record.finish not in FINISH_REASONS:
                raise PeerError(f"GPU peer ended the request with {record.finish.name}")
            text += stops.feed(self._detok.finish())
            text += stops.flush()
        if stops.matched is not None:
            self.request.cancel()  # stop generating at once; the rest is not wanted
            return Delta(self.index, text, "stop", self._count, lps, received)
        if final:
            return Delta(self.index, text, FINISH_REASONS[record.finish], self._count, lps,
                         received)
        if text or lps:
            return Delta(self.index, text, None, self._count, lps, received)
        return None

    def _push_with_logprobs(self, record: ResponseRecord) -> tuple[str, tuple[TokenLogprob, ...]]:
        """The record's text, a token at a time so that each token's offset is known, and
        its tokens' log probabilities: checked, since they come from the GPU side."""
        entries = record.logprobs
        if record.tokens and (entries is None or len(entries) != len(record.tokens)):
            raise PeerError("GPU peer sent tokens without the log probabilities the request "
                            "asked for")
        k = self._logprobs or 0
        texts, out = [], []
        for token, entry in zip(record.tokens, entries or (), strict=True):
            # Fewer alternatives than asked is an answer (ids of zero probability are not
            # listed); more are cut. Ids must be the vocabulary's: they become text.
            top = entry.top[:k]
            if any(t >= self._vocab_size for t, _ in top):
                raise PeerError("GPU peer sent an alternative token id outside the "
                                f"vocabulary ({self._vocab_size} ids)")
            out.append(TokenLogprob(token, entry.logprob, top, self._chars))
            text = self._detok.push((token,))
            self._chars += len(text)
            texts.append(text)
        return "".join(texts), tuple(out)
