"""The layout record (protocol v2.2): what the GPU side publishes at offset 0 of its region.

The daemon reads it once per connection (an RDMA READ, or a copy over shm)
and refuses to run on anything it does not understand: a wrong magic, another
major version or a geometry that points outside the region is a
``LayoutMismatch`` at start-up, never silent corruption. docs/protocol.md,
section "Layout record", is the byte-by-byte specification.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dpu_frontend.errors import LayoutMismatch
from dpu_frontend.flags import about
from dpu_frontend.ring.cstruct import CStruct

MAGIC = b"DPUFRING"
VERSION_MAJOR = 2
#: 1: log probabilities (channel features, request and response fields); 2: structured
#: output's automata (a channel feature and its bound, a request flag and the automaton's
#: size; the automaton follows the prompt in the arena).
VERSION_MINOR = 2

#: Every block, ring and prompt span starts on a 128-byte boundary: the GPU's
#: L2 line and a full PCIe/NIC cache line on the Arm cores, so no two owners
#: ever share a line and a record is never split across two.
ALIGN = 128

HEADER_STRUCT = CStruct("dpuf_layout_header", (
    ("magic", "8s"), ("version_major", "H"), ("version_minor", "H"), ("header_size", "I"),
    ("region_size", "Q"), ("instance", "Q"), ("channel_count", "I"),
    ("channel_desc_size", "I"),
), 128)
CHANNEL_STRUCT = CStruct("dpuf_channel_desc", (
    ("req_ring_offset", "Q"), ("req_slots", "I"), ("req_slot_size", "I"),
    ("arena_offset", "Q"), ("arena_size", "Q"), ("resp_ring_offset", "Q"),
    ("resp_slots", "I"), ("resp_slot_size", "I"), ("gpu_ctrl_offset", "Q"),
    ("dpu_ctrl_offset", "Q"), ("max_sequences", "I"), ("max_prompt_tokens", "I"),
    ("features", "I"), ("max_top_logprobs", "I"), ("max_automaton_bytes", "I"),
), 128)
HEADER = HEADER_STRUCT.codec
HEADER_SIZE = HEADER_STRUCT.size
CHANNEL = CHANNEL_STRUCT.codec
CHANNEL_SIZE = CHANNEL_STRUCT.size

#: GPU-owned control block of a channel (the DPU only reads it).
GPU_CTRL_STRUCT = CStruct("dpuf_gpu_ctrl", (
    ("resp_produced", "Q"), ("req_consumed", "Q"), ("heartbeat", "Q"), ("epoch", "Q"),
), 128)
#: DPU-owned control block of a channel (the GPU only reads it).
DPU_CTRL_STRUCT = CStruct("dpuf_dpu_ctrl", (("resp_consumed", "Q"),), 128)
GPU_CTRL = GPU_CTRL_STRUCT.codec
DPU_CTRL = DPU_CTRL_STRUCT.codec
CTRL_SIZE = 128

#: Request records have one fixed size (see records.py).
REQUEST_SLOT_SIZE = 128
#: A response record is a 32-byte header followed by u32 token ids.
RESPONSE_HEADER_SIZE = 32
MIN_RESPONSE_SLOT_SIZE = 64
#: ``n_tokens`` is a u16: a record carries at most 65535 tokens.
MAX_RESPONSE_SLOT_SIZE = RESPONSE_HEADER_SIZE + 4 * 0xFFFF
#: One token of a record that carries log probabilities: the id, its log probability
#: and up to ``MAX_TOP_LOGPROBS`` alternatives (ids, then their log probabilities).
MAX_TOP_LOGPROBS = 5
TOKEN_LOGPROBS_STRUCT = CStruct("dpuf_token_logprobs", (
    ("token", "I"), ("logprob", "f"), ("top_ids", f"{MAX_TOP_LOGPROBS}I"),
    ("top_logprobs", f"{MAX_TOP_LOGPROBS}f"),
), 48)
#: Channel feature bits (``features`` of the channel descriptor): log probabilities
#: (minor version 1), structured output's automata (minor version 2).
FEATURE_LOGPROBS = 1 << 0
FEATURE_CONSTRAINTS = 1 << 1
#: An automaton's header (``ring.automaton``): a channel that takes automata takes one
#: at least this large.
AUTOMATON_HEADER_SIZE = 64
#: The smallest response slot that holds one token with its log probabilities.
MIN_LOGPROBS_SLOT_SIZE = 96
#: Response slots are whole 32-byte sectors, so that 128-byte-aligned rings
#: never put two slots' headers in one sector.
RESPONSE_SLOT_UNIT = 32


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def holds_automaton(arena_bytes: int, prompt_tokens: int, automaton_bytes: int) -> bool:
    """Whether an arena holds the longest prompt and, after it, the largest automaton
    (which is at least a header)."""
    return (automaton_bytes >= AUTOMATON_HEADER_SIZE
            and align(4 * prompt_tokens) + automaton_bytes <= arena_bytes)


@dataclass(frozen=True, slots=True)
class ChannelLayout:
    """Where one ring pair lives in the region, and its geometry."""

    req_ring_offset: int
    req_slots: int
    req_slot_size: int
    arena_offset: int
    arena_size: int
    resp_ring_offset: int
    resp_slots: int
    resp_slot_size: int
    gpu_ctrl_offset: int
    dpu_ctrl_offset: int
    max_sequences: int  # generate records the DPU may have open (sent, not finished)
    max_prompt_tokens: int  # the longest prompt the GPU side takes
    features: int = 0  # FEATURE_* bits (zero in a minor-0 layout: reserved bytes)
    max_top_logprobs: int = 0  # alternatives per token the GPU side gives, with logprobs
    max_automaton_bytes: int = 0  # with FEATURE_CONSTRAINTS: the largest automaton it takes

    @property
    def tokens_per_response(self) -> int:
        return (self.resp_slot_size - RESPONSE_HEADER_SIZE) // 4

    @property
    def logprobs(self) -> bool:
        """Whether the GPU side computes log probabilities (a request may ask for them)."""
        return bool(self.features & FEATURE_LOGPROBS)

    def offers_logprobs(self, asked: int | None) -> bool:
        """Whether a request asking for ``asked`` alternatives (None: no log
        probabilities) can be served on this channel."""
        return asked is None or (self.logprobs and asked <= self.max_top_logprobs)

    @property
    def constraints(self) -> bool:
        """Whether the GPU side walks structured output's automata."""
        return bool(self.features & FEATURE_CONSTRAINTS)

    @property
    def logprob_tokens_per_response(self) -> int:
        """Tokens one record carries with their log probabilities."""
        return (self.resp_slot_size - RESPONSE_HEADER_SIZE) // TOKEN_LOGPROBS_STRUCT.size

    @property
    def arena_tokens(self) -> int:
        return self.arena_size // 4

    def req_slot_offset(self, seq: int) -> int:
        """Offset of the slot that request record number ``seq`` (1-based) uses."""
        return self.req_ring_offset + ((seq - 1) % self.req_slots) * self.req_slot_size

    def resp_slot_offset(self, position: int) -> int:
        """Offset of the slot of response record ``position`` (0-based)."""
        return self.resp_ring_offset + (position % self.resp_slots) * self.resp_slot_size

    def spans(self) -> list[tuple[str, int, int]]:
        return [
            ("request ring", self.req_ring_offset, self.req_slots * self.req_slot_size),
            ("prompt arena", self.arena_offset, self.arena_size),
            ("response ring", self.resp_ring_offset, self.resp_slots * self.resp_slot_size),
            ("gpu control block", self.gpu_ctrl_offset, CTRL_SIZE),
            ("dpu control block", self.dpu_ctrl_offset, CTRL_SIZE),
        ]


@dataclass(frozen=True, slots=True)
class Layout:
    """The decoded layout record."""

    region_size: int
    instance: int
    channels: tuple[ChannelLayout, ...]
    version_major: int = VERSION_MAJOR
    version_minor: int = VERSION_MINOR

    @property
    def header_size(self) -> int:
        return HEADER_SIZE + CHANNEL_SIZE * len(self.channels)

    def encode(self) -> bytes:
        out = bytearray(self.header_size)
        HEADER.pack_into(
            out, 0, MAGIC, self.version_major, self.version_minor, self.header_size,
            self.region_size, self.instance, len(self.channels), CHANNEL_SIZE,
        )
        for i, ch in enumerate(self.channels):
            CHANNEL.pack_into(
                out, HEADER_SIZE + i * CHANNEL_SIZE,
                ch.req_ring_offset, ch.req_slots, ch.req_slot_size,
                ch.arena_offset, ch.arena_size,
                ch.resp_ring_offset, ch.resp_slots, ch.resp_slot_size,
                ch.gpu_ctrl_offset, ch.dpu_ctrl_offset, ch.max_sequences, ch.max_prompt_tokens,
                ch.features, ch.max_top_logprobs, ch.max_automaton_bytes,
            )
        return bytes(out)


def decode_header_size(data: bytes | memoryview) -> int:
    """How many bytes the whole layout record has, from its first 128 bytes.

    The daemon reads 128 bytes, learns the size, then reads the channel table.
    """
    magic, major, _minor, header_size, *_ = HEADER.unpack_from(data, 0)
    _check_magic_version(magic, major)
    return int(header_size)


def decode_layout(data: bytes | memoryview) -> Layout:
    if len(data) < HEADER_SIZE:
        raise LayoutMismatch(f"layout record truncated: {len(data)} bytes < {HEADER_SIZE}")
    magic, major, minor, header_size, region_size, instance, count, desc_size = (
        HEADER.unpack_from(data, 0)
    )
    _check_magic_version(magic, major)
    if desc_size != CHANNEL_SIZE:
        raise LayoutMismatch(f"channel descriptor size {desc_size}, this daemon needs {CHANNEL_SIZE}")
    if count < 1:
        raise LayoutMismatch("layout record declares no channel")
    if header_size != HEADER_SIZE + count * CHANNEL_SIZE or len(data) < header_size:
        raise LayoutMismatch(f"layout record size {header_size} inconsistent with {count} channels")
    channels = tuple(
        ChannelLayout(*CHANNEL.unpack_from(data, HEADER_SIZE + i * CHANNEL_SIZE))
        for i in range(count)
    )
    if minor == 0:  # the feature words were reserved: a v2.0 peer offers no feature
        channels = tuple(replace(ch, features=0, max_top_logprobs=0, max_automaton_bytes=0)
                         for ch in channels)
    elif minor == 1:  # the automaton's bound was reserved, and so was its feature bit
        channels = tuple(replace(ch, features=ch.features & FEATURE_LOGPROBS,
                                 max_automaton_bytes=0) for ch in channels)
    layout = Layout(region_size, instance, channels, major, minor)
    validate(layout)
    return layout


def _check_magic_version(magic: bytes, major: int) -> None:
    if magic != MAGIC:
        raise LayoutMismatch(f"bad magic {magic!r}: the peer is not a dpu-frontend ring peer")
    if major != VERSION_MAJOR:
        raise LayoutMismatch(version_refusal(major))


def version_refusal(major: object) -> str:
    """The one message for a peer of another protocol version (v1 peers included)."""
    hint = (" (v1 has no epochs, mailbox or multi-warp publishing: upgrade the GPU peer)"
            if major == 1 else "")
    return f"peer speaks ring protocol v{major}, this daemon speaks v{VERSION_MAJOR}{hint}"


def validate(layout: Layout) -> None:
    """Check a layout's geometry; raise ``LayoutMismatch`` naming the bad field."""
    if layout.instance == 0:
        raise LayoutMismatch("instance must be non-zero")
    spans: list[tuple[str, int, int]] = [("layout record", 0, layout.header_size)]
    for i, ch in enumerate(layout.channels):
        where = f"channel {i}"
        if ch.req_slot_size != REQUEST_SLOT_SIZE:
            raise LayoutMismatch(f"{where}: request slot size {ch.req_slot_size} != {REQUEST_SLOT_SIZE}")
        if ch.req_slots < 1 or ch.resp_slots < 2:
            raise LayoutMismatch(f"{where}: needs >= 1 request slot and >= 2 response slots")
        if (not MIN_RESPONSE_SLOT_SIZE <= ch.resp_slot_size <= MAX_RESPONSE_SLOT_SIZE
                or ch.resp_slot_size % RESPONSE_SLOT_UNIT):
            raise LayoutMismatch(f"{where}: response slot size {ch.resp_slot_size} invalid")
        if ch.arena_size < ALIGN or ch.arena_size % ALIGN:
            raise LayoutMismatch(f"{where}: arena size {ch.arena_size} not a multiple of {ALIGN}")
        if ch.max_sequences < 1:
            raise LayoutMismatch(f"{where}: max_sequences must be >= 1")
        if ch.resp_slots < 2 * ch.max_sequences:
            raise LayoutMismatch(f"{where}: {ch.resp_slots} response slots cannot hold two "
                                 f"steps of {ch.max_sequences} sequences")
        if ch.logprobs and not 0 <= ch.max_top_logprobs <= MAX_TOP_LOGPROBS:
            raise LayoutMismatch(f"{where}: max_top_logprobs {ch.max_top_logprobs} outside "
                                 f"[0, {MAX_TOP_LOGPROBS}]")
        if ch.logprobs and ch.resp_slot_size < MIN_LOGPROBS_SLOT_SIZE:
            raise LayoutMismatch(f"{where}: response slot size {ch.resp_slot_size} cannot "
                                 "hold a token with its log probabilities "
                                 f"({MIN_LOGPROBS_SLOT_SIZE} bytes)")
        if not 1 <= ch.max_prompt_tokens <= ch.arena_tokens:
            raise LayoutMismatch(f"{where}: max_prompt_tokens {ch.max_prompt_tokens} outside "
                                 f"[1, {ch.arena_tokens}] (the arena)")
        if ch.constraints and not holds_automaton(ch.arena_size, ch.max_prompt_tokens,
                                                  ch.max_automaton_bytes):
            raise LayoutMismatch(f"{where}: the arena ({ch.arena_size} bytes) cannot hold the "
                                 f"longest prompt and an automaton of max_automaton_bytes "
                                 f"{ch.max_automaton_bytes}")
        for name, offset, size in ch.spans():
            if offset % ALIGN:
                raise LayoutMismatch(f"{where}: {name} at {offset} is not {ALIGN}-byte aligned")
            spans.append((f"{where} {name}", offset, size))
    spans.sort(key=lambda s: s[1])
    end = 0
    for name, offset, size in spans:
        if offset < end:
            raise LayoutMismatch(f"{name} at {offset} overlaps the previous span")
        end = offset + size
    if end > layout.region_size:
        raise LayoutMismatch(f"geometry needs {end} bytes, region has {layout.region_size}")


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the GPU side chooses for each channel; ``plan`` places it.

    A decode step emits one record per running sequence, so the response ring
    holds at least two steps of the largest batch (``resp_slots >= 2 *
    max_sequences``): the GPU can publish one step while the DPU reads the
    previous one. Each field is a flag of the peers (``flags.Flags``).
    """

    channels: int = field(default=1, metadata=about("ring pairs (one per daemon worker)"))
    req_slots: int = field(default=256, metadata=about("request slots per channel"))
    arena_bytes: int = field(default=4 << 20, metadata=about(
        f"bytes of a channel's prompt arena, a multiple of {ALIGN}"))
    resp_slots: int = field(default=1024, metadata=about(
        "response slots per channel, >= 2 x --max-sequences"))
    resp_slot_size: int = field(default=MIN_LOGPROBS_SLOT_SIZE, metadata=about(
        "bytes per response record"))
    max_sequences: int = field(default=256, metadata=about(
        "sequences a channel runs at once"))
    max_prompt_tokens: int = field(default=0, metadata=about(
        "longest prompt taken, 0: the whole arena"))
    # The GPU side computes log probabilities (FEATURE_LOGPROBS).
    logprobs: bool = field(default=True, metadata=about(
        f"offer log probabilities (needs --resp-slot-size >= {MIN_LOGPROBS_SLOT_SIZE})"))
    # The GPU side walks structured output's automata (FEATURE_CONSTRAINTS); a request's
    # automaton follows its prompt in the arena.
    max_automaton_bytes: int = field(default=0, metadata=about(
        "the largest structured-output automaton a request may carry; the arena holds it "
        "beside the longest prompt; 0: no structured output"))

    def __post_init__(self) -> None:
        if self.channels < 1:
            raise ValueError("channels must be >= 1")
        if self.req_slots < 1:
            raise ValueError("req_slots must be >= 1")
        if self.max_sequences < 1:
            raise ValueError("max_sequences must be >= 1")
        if self.resp_slots < 2 * self.max_sequences:
            raise ValueError(f"resp_slots must be >= 2 * max_sequences ({2 * self.max_sequences})")
        if self.arena_bytes < ALIGN or self.arena_bytes % ALIGN:
            raise ValueError(f"arena_bytes must be a positive multiple of {ALIGN}")
        if (not MIN_RESPONSE_SLOT_SIZE <= self.resp_slot_size <= MAX_RESPONSE_SLOT_SIZE
                or self.resp_slot_size % RESPONSE_SLOT_UNIT):
            raise ValueError(f"resp_slot_size must be a multiple of {RESPONSE_SLOT_UNIT} in "
                             f"[{MIN_RESPONSE_SLOT_SIZE}, {MAX_RESPONSE_SLOT_SIZE}]")
        if not 0 <= self.max_prompt_tokens <= self.arena_bytes // 4:
            raise ValueError(f"max_prompt_tokens must be in [0, {self.arena_bytes // 4}] "
                             "(0: the whole arena)")
        if self.max_automaton_bytes and not (
                self.prompt_tokens >= 1
                and holds_automaton(self.arena_bytes, self.prompt_tokens,
                                    self.max_automaton_bytes)):
            raise ValueError(f"max_automaton_bytes ({self.max_automaton_bytes}) and the "
                             f"longest prompt must fit the arena ({self.arena_bytes} bytes), "
                             f"and an automaton takes at least {AUTOMATON_HEADER_SIZE}: lower "
                             "max_automaton_bytes (0: no structured output) or raise "
                             "arena_bytes")
        if self.logprobs and self.resp_slot_size < MIN_LOGPROBS_SLOT_SIZE:
            raise ValueError(f"resp_slot_size must be >= {MIN_LOGPROBS_SLOT_SIZE} to carry "
                             "log probabilities (or turn them off: --no-logprobs)")

    @property
    def prompt_tokens(self) -> int:
        """The longest prompt: ``max_prompt_tokens``, or what the arena holds beside an
        automaton (in whole 128-byte lines)."""
        return self.max_prompt_tokens or (
            (self.arena_bytes - align(self.max_automaton_bytes)) // ALIGN * ALIGN // 4)

    def plan(self, instance: int) -> Layout:
        """Place every channel's blocks one after another, each 128-byte aligned."""
        offset = align(HEADER_SIZE + CHANNEL_SIZE * self.channels)
        channels = []
        for _ in range(self.channels):
            gpu_ctrl = offset
            dpu_ctrl = gpu_ctrl + CTRL_SIZE
            req = dpu_ctrl + CTRL_SIZE
            arena = align(req + self.req_slots * REQUEST_SLOT_SIZE)
            resp = align(arena + self.arena_bytes)
            offset = align(resp + self.resp_slots * self.resp_slot_size)
            channels.append(ChannelLayout(
                req_ring_offset=req, req_slots=self.req_slots, req_slot_size=REQUEST_SLOT_SIZE,
                arena_offset=arena, arena_size=self.arena_bytes,
                resp_ring_offset=resp, resp_slots=self.resp_slots,
                resp_slot_size=self.resp_slot_size,
                gpu_ctrl_offset=gpu_ctrl, dpu_ctrl_offset=dpu_ctrl,
                max_sequences=self.max_sequences, max_prompt_tokens=self.prompt_tokens,
                features=((FEATURE_LOGPROBS if self.logprobs else 0)
                          | (FEATURE_CONSTRAINTS if self.max_automaton_bytes else 0)),
                max_top_logprobs=MAX_TOP_LOGPROBS if self.logprobs else 0,
                max_automaton_bytes=self.max_automaton_bytes,
            ))
        layout = Layout(region_size=align(offset, 4096), instance=instance, channels=tuple(channels))
        validate(layout)
        return layout
