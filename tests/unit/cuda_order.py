"""The CUDA side's memory order, read from its sources: CI has no GPU to run them on.

The kernels' loads and stores cannot run here, so their order is read from the
text, function by function (``__device__``, ``__global__``, ``DPUF_HD``: the body
between matching braces, comments and strings blanked), in the order the
statements are written. These are docs/protocol.md's rules for the GPU side
(sections 6.1, 6.2, 6.4, 7.1, 7.2), each with why:

1. **A fence before each marker's release** (``seq``, ``resp_produced``,
   ``req_consumed``, ``epoch``): ``__threadfence_system()`` after the function's
   last store into the rings, prompt copy or ring reset, before the
   ``dpuf_store_release_sys``. The data is written by other threads than the one
   that releases the marker, and a release orders only its own thread's stores.
2. **A response record's seq is its slot's last store**: no store to the slot
   after the release, or the DPU may read the body before it is written.
3. **A barrier before a one-thread release** (under ``lane == 0``,
   ``threadIdx.x == 0``, ``t == 0``): a ``__syncwarp()`` or ``__syncthreads()``
   between the last store, copy or reset of all threads and the guarded block,
   or the releasing thread may publish before the others have written (their
   fences done) or read (their prompt loads returned).
4. **req_consumed after the record and its prompt**: every ``read_request``
   and ``copy_prompt`` of the function comes before the store, with a
   ``__syncthreads()`` after the last copy (all threads copy): the DPU rewrites
   a slot and its arena span as soon as it sees the index.
5. **epoch last at an attach**: the store follows the function's
   ``reset_rings``, with a fence and a ``__syncthreads()`` between them, so a DPU
   that sees the epoch sees clean rings and zero counters.
6. **Markers are release stores**: no plain ``store_vol_*`` of ``seq``,
   ``resp_produced``, ``req_consumed``, ``epoch`` or ``heartbeat`` outside
   ``reset_rings`` (whose zeroes the caller's fence and epoch release publish).
7. **Acquire loads**: ``resp_consumed`` is read only through
   ``dpuf_load_acquire_sys``, and ``read_request`` loads the commit word that
   way before any load of the body.
8. **Fresh loads of the body and the prompt**: in ``read_request`` every use of
   the slot is the acquire or an ``__ldcv``; in ``copy_prompt`` every use of the
   source is an ``__ldcv`` or ``dpuf_load_fresh_u32``: the slot and the span are
   rewritten every lap, and a cached line could hold the last lap's bytes.
9. **The mailbox's ack after its answer**: ``ack_seq`` is released after the
   stores of ``state`` and ``error``.

Every ``dpuf_store_release_sys`` must name a target these rules know: a new
marker, or a release moved into a helper that hides its target, fails as
"unknown" until it is classified here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import dpu_frontend

#: Every CUDA source of the package (and the protocol header), found by name wherever
#: it lives in the package.
SOURCES = ("ring_protocol.h", "ring_device.cuh", "record_writer.cuh", "record_writer.cu",
           "peer_kernel.cu", "scheduler.cu", "cuda_host.cuh", "cuda_driver.cuh",
           "automaton_pool.cuh", "allreduce.cu")
ORDERED = ("seq", "resp_produced", "req_consumed", "epoch")
STORES = ("store_vol_u32", "store_vol_u64", "volatile store", "copy_prompt", "reset_rings")
BARRIERS = ("__syncthreads", "__syncwarp")
_CALLS = ("dpuf_store_release_sys", "dpuf_load_acquire_sys", "store_vol_u32", "store_vol_u64",
          "__threadfence_system", "__syncthreads", "__syncwarp", "copy_prompt", "read_request",
          "read_record", "reset_rings", "__ldcv", "dpuf_load_fresh_u32")
_CALL = re.compile(r"\b(" + "|".join(_CALLS) + r")\s*\(")
_VOLATILE_STORE = re.compile(r"\*\s*\(\s*volatile\s+[\w\s]+\*\s*\)\s*(\([^;=]*\)|\w+)\s*=(?!=)")
#: Comments, string and character literals, preprocessor lines (with their continuations).
_BLANK = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'"
                    r"|^[ \t]*#(?:\\.|[^\n\\])*", re.S | re.M)
_HEAD = re.compile(r"\b(?:__device__|__global__|DPUF_HD)\b[^;{}]*\{")
_NAME = re.compile(r"(\w+)\s*\(")
_DECLARATION = re.compile(r"\s*const\s+\w+\s*\*\s*(\w+\s*=\s*\(\s*const\s+\w+\s*\*\s*\)\s*)?")
_GUARD = re.compile(r"\b(?:lane|threadIdx\.x|t)\s*==\s*0\b")


@dataclass(frozen=True)
class Event:
    kind: str  # a name of _CALLS, or "volatile store"
    start: int
    end: int
    target: str  # the first argument (a call), the left side (a volatile store)


@dataclass(frozen=True)
class Function:
    file: str
    name: str
    body: str  # from "{" to its "}", comments and strings blanked

    def events(self) -> list[Event]:
        out = []
        for m in _CALL.finditer(self.body):
            end = _close(self.body, m.end() - 1)
            out.append(Event(m.group(1), m.start(), end, _first_arg(self.body[m.end():end - 1])))
        for m in _VOLATILE_STORE.finditer(self.body):
            out.append(Event("volatile store", m.start(), m.end(), m.group(1)))
        return sorted(out, key=lambda e: e.start)

    def guard(self, at: int) -> int | None:
        """Where the innermost block around ``at`` whose condition picks one thread opens."""
        opened: list[int] = []
        for i, c in enumerate(self.body[:at]):
            if c == "{":
                opened.append(i)
            elif c == "}" and opened:
                opened.pop()
        for brace in reversed(opened):
            head = re.split(r"[;{}]", self.body[:brace])[-1]
            if _GUARD.search(head):
                return brace
        return None


def device_sources(root: Path = Path(dpu_frontend.__file__).parent) -> dict[str, str]:
    """Each of SOURCES by name; a CUDA source not among them is an error (its order
    would go unchecked)."""
    out = {}
    for name in SOURCES:
        found = sorted(root.rglob(name))
        if len(found) != 1:
            raise AssertionError(f"{name}: {len(found)} files under {root}")
        out[name] = found[0].read_text()
    unknown = {p.name for p in root.rglob("*.cu*")} - set(SOURCES)
    if unknown:
        raise AssertionError(f"CUDA sources not in cuda_order.SOURCES: {sorted(unknown)}")
    return out


def functions(file: str, text: str) -> list[Function]:
    text = _BLANK.sub(lambda m: '""' if m.group(0)[0] in "\"'" else " ", text)
    out = []
    for m in _HEAD.finditer(text):
        names = _NAME.findall(m.group(0))
        if names:
            out.append(Function(file, names[-1], text[m.end() - 1:_close(text, m.end() - 1)]))
    return out


def marker(function: Function, target: str) -> str:
    """What a release store's target is."""
    for name in ("resp_produced", "req_consumed", "heartbeat", "ack_seq"):
        if re.search(rf"\b{name}\b", target):
            return name
    if re.search(r"->\s*epoch\b", target):
        return "epoch"
    if re.search(r"kblock\s*->\s*state\b", target):
        return "kernel state"
    if re.fullmatch(r"(\(\s*volatile\s+uint64_t\s*\*\s*\))?\s*slot", target.strip()) \
            and "dpuf_resp_slot_offset" in function.body:
        return "seq"
    return "unknown"


def violations(sources: dict[str, str]) -> list[str]:
    """Every broken rule, as "file: function: what"."""
    out: list[str] = []
    for file, text in sources.items():
        for function in functions(file, text):
            out += [f"{file}: {function.name}: {v}" for v in _check(function)]
    return out


def releases(sources: dict[str, str]) -> dict[str, list[str]]:
    """The functions that release each marker, for a test to see the rules had work."""
    out: dict[str, list[str]] = {}
    for file, text in sources.items():
        for function in functions(file, text):
            for e in function.events():
                if e.kind == "dpuf_store_release_sys":
                    out.setdefault(marker(function, e.target), []).append(function.name)
    return out


def _check(f: Function) -> list[str]:
    events = f.events()
    out = []
    for r in (e for e in events if e.kind == "dpuf_store_release_sys"):
        kind = marker(f, r.target)
        before = [e for e in events if e.end <= r.start]
        if kind == "unknown":
            out.append(f"release of an unknown target {r.target!r}: classify it in cuda_order")
        if kind in ORDERED:
            out += _fenced(kind, before)
            out += _guarded(f, kind, r, before)
        if kind == "seq" and any(e.kind in STORES and "slot" in e.target
                                 for e in events if e.start > r.start):
            out.append("a store to the slot after its seq release")
        if kind == "req_consumed":
            out += _consumed(events, r, before)
        if kind == "epoch":
            out += _epoch(before)
        if kind == "ack_seq" and any(e.kind in STORES and re.search(r"\b(state|error)\b", e.target)
                                     for e in events if e.start > r.start):
            out.append("ack_seq released before the state or error it acknowledges")
    if f.name != "reset_rings":
        out += _plain_markers(f, events)
        out += _acquired(f, events)
    if f.name == "read_request":
        out += _fresh(f, events, "slot", ("__ldcv", "dpuf_load_acquire_sys"))
        loads = [e.start for e in events if e.kind == "__ldcv"]
        acquire = [e.start for e in events if e.kind == "dpuf_load_acquire_sys"]
        if not acquire or (loads and min(loads) < acquire[0]):
            out.append("the body loaded before the commit word's acquire load")
    if f.name == "copy_prompt":
        out += _fresh(f, events, "src4?", ("__ldcv", "dpuf_load_fresh_u32"))
    return out


def _fenced(kind: str, before: list[Event]) -> list[str]:
    fences = [e.start for e in before if e.kind == "__threadfence_system"]
    stores = [e.start for e in before if e.kind in STORES]
    if not fences or (stores and stores[-1] > fences[-1]):
        return [f"{kind} released without a __threadfence_system() after the last store"]
    return []


def _guarded(f: Function, kind: str, r: Event, before: list[Event]) -> list[str]:
    guard = f.guard(r.start)
    if guard is None:
        return []
    stores = [e.start for e in before if e.kind in STORES and e.start < guard]
    barriers = [e.start for e in before if e.kind in BARRIERS and e.start < guard]
    if stores and (not barriers or barriers[-1] < stores[-1]):
        return [f"{kind} released by one thread with no barrier after the other threads' stores"]
    return []


def _consumed(events: list[Event], r: Event, before: list[Event]) -> list[str]:
    out = []
    reads = [e for e in events if e.kind in ("read_request", "read_record", "copy_prompt")]
    if not any(e.kind != "copy_prompt" for e in reads):
        out.append("req_consumed stored where no request record is read")
    if any(e.start > r.start for e in reads):
        out.append("req_consumed stored before the record or its prompt is read")
    copies = [e.start for e in before if e.kind == "copy_prompt"]
    syncs = [e.start for e in before if e.kind == "__syncthreads"]
    if copies and (not syncs or syncs[-1] < copies[-1]):
        out.append("req_consumed stored with no __syncthreads() after the prompt copy")
    return out


def _epoch(before: list[Event]) -> list[str]:
    resets = [e.start for e in before if e.kind == "reset_rings"]
    if not resets:
        return ["epoch stored where no ring is reset"]
    after = {e.kind for e in before if e.start > resets[-1]}
    if not {"__threadfence_system", "__syncthreads"} <= after:
        return ["epoch stored without a fence and a __syncthreads() after the reset"]
    return []


def _plain_markers(f: Function, events: list[Event]) -> list[str]:
    out = []
    for e in events:
        if e.kind in ("store_vol_u32", "store_vol_u64", "volatile store"):
            kind = marker(f, e.target)
            if kind in (*ORDERED, "heartbeat"):
                out.append(f"{kind} stored with a plain store, not a release")
    return out


def _acquired(f: Function, events: list[Event]) -> list[str]:
    spans = [(e.start, e.end) for e in events if e.kind == "dpuf_load_acquire_sys"]
    for m in re.finditer(r"(->|\.)\s*resp_consumed\b", f.body):
        if not any(start < m.start() < end for start, end in spans):
            return ["resp_consumed read without an acquire load"]
    return []


def _fresh(f: Function, events: list[Event], name: str, loads: tuple[str, ...]) -> list[str]:
    spans = [(e.start, e.end) for e in events if e.kind in loads]
    for m in re.finditer(rf"\b{name}\b", f.body):
        statement = re.split(r"[;{}]", f.body[:m.start()])[-1]
        if _DECLARATION.fullmatch(statement):
            continue  # the pointer declared, or an alias of it (checked in its turn)
        if not any(start < m.start() < end for start, end in spans):
            return [f"{m.group(0)} read without a fresh load (__ldcv)"]
    return []


def _close(text: str, opening: int) -> int:
    """The index after the bracket that closes the one at ``opening``."""
    pairs = {"(": ")", "{": "}"}
    want, depth = pairs[text[opening]], 0
    for i in range(opening, len(text)):
        if text[i] == text[opening]:
            depth += 1
        elif text[i] == want:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {text[opening]!r} at {opening}")


def _first_arg(args: str) -> str:
    depth = 0
    for i, c in enumerate(args):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            return args[:i]
    return args
