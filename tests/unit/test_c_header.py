"""The C headers (the ring protocol, the CUDA peer, the record writer, the GPU
scheduler's core) checked against the Python codecs and mirrors.

A C compiler builds a small program that includes the headers and prints,
for every structure the Python side describes (``CStruct``), its ``sizeof``
and each field's ``offsetof``, the protocol constants, and the bytes of one
golden record of every type filled in C; the test compares all of it with
the Python struct formats and encoders. The C side and the Python side
therefore cannot drift apart without CI going red.
"""

from __future__ import annotations

import ctypes
import fnmatch
import json
import re
import shutil
import subprocess
import tomllib
from array import array
from pathlib import Path

import numpy as np
import pytest

import dpu_frontend
from dpu_frontend.gpu.library import CudaLibrary, DeviceInfo
from dpu_frontend.gpu.runtime import (
    ALLREDUCE,
    ALLREDUCE_HOST,
    PEER_SOURCES,
    STEP_RELAY_HOST,
    WALK_HOST,
    CudaSources,
    PeerLibrary,
    PeerParams,
)
from dpu_frontend.model import publish as publish_mod
from dpu_frontend.model import sampling
from dpu_frontend.model.device import RECORDS, SCHED_HOST, SCHEDULER, sched_core
from dpu_frontend.model.device.sched_core import (
    ModelParams,
    ModelStats,
    SchedConfig,
    SchedulerLibrary,
    SeqState,
)
from dpu_frontend.model.publish import WriterChannel, WriterLibrary, WriterParams
from dpu_frontend.ring import (
    CancelRecord,
    FinishReason,
    GenerateRecord,
    Geometry,
    ResponseRecord,
    SamplingParams,
    TokenLogprobs,
)
from dpu_frontend.ring import layout as layout_mod
from dpu_frontend.ring import records as records_mod
from dpu_frontend.ring.automaton import (
    AUTOMATON_STRUCT,
    NONE,
    TokenAutomaton,
    encode_automaton,
)
from dpu_frontend.ring.cstruct import CStruct
from dpu_frontend.ring.layout import (
    CHANNEL_STRUCT,
    DPU_CTRL_STRUCT,
    GPU_CTRL_STRUCT,
    HEADER_STRUCT,
    TOKEN_LOGPROBS_STRUCT,
)
from dpu_frontend.ring.mailbox import COUNTERS, KERNEL_BLOCK, MAILBOX
from dpu_frontend.ring.records import REQUEST_STRUCT, RESPONSE_STRUCT

STRUCTS = (HEADER_STRUCT, CHANNEL_STRUCT, GPU_CTRL_STRUCT, DPU_CTRL_STRUCT, REQUEST_STRUCT,
           RESPONSE_STRUCT, TOKEN_LOGPROBS_STRUCT, AUTOMATON_STRUCT, KERNEL_BLOCK, MAILBOX)
CTYPES_MIRRORS = {"dpuf_peer_params": PeerParams, "dpuf_device_info": DeviceInfo,
                  "dpuf_writer_params": WriterParams, "dpuf_writer_channel": WriterChannel,
                  "dpuf_sched_config": SchedConfig, "dpuf_sched_seq": SeqState,
                  "dpuf_model_params": ModelParams, "dpuf_model_stats": ModelStats}
CONSTANTS = {
    "DPUF_VERSION_MAJOR": layout_mod.VERSION_MAJOR, "DPUF_VERSION_MINOR": layout_mod.VERSION_MINOR,
    "DPUF_ALIGN": layout_mod.ALIGN, "DPUF_HEADER_SIZE": layout_mod.HEADER_SIZE,
    "DPUF_CHANNEL_DESC_SIZE": layout_mod.CHANNEL_SIZE, "DPUF_CTRL_SIZE": layout_mod.CTRL_SIZE,
    "DPUF_REQUEST_SLOT_SIZE": layout_mod.REQUEST_SLOT_SIZE,
    "DPUF_RESPONSE_HEADER_SIZE": layout_mod.RESPONSE_HEADER_SIZE,
    "DPUF_MIN_RESPONSE_SLOT_SIZE": layout_mod.MIN_RESPONSE_SLOT_SIZE,
    "DPUF_MAX_STOP_TOKEN_IDS": records_mod.MAX_STOP_TOKEN_IDS,
    "DPUF_KIND_GENERATE": records_mod.RecordKind.GENERATE,
    "DPUF_KIND_CANCEL": records_mod.RecordKind.CANCEL,
    "DPUF_FLAG_IGNORE_EOS": records_mod.FLAG_IGNORE_EOS,
    "DPUF_FLAG_HAS_SEED": records_mod.FLAG_HAS_SEED,
    "DPUF_FLAG_LOGPROBS": records_mod.FLAG_LOGPROBS,
    "DPUF_FLAG_CONSTRAINED": records_mod.FLAG_CONSTRAINED,
    "DPUF_FEATURE_CONSTRAINTS": layout_mod.FEATURE_CONSTRAINTS,
    "DPUF_AUTOMATON_HEADER_SIZE": layout_mod.AUTOMATON_HEADER_SIZE,
    "DPUF_AUTOMATON_NONE": NONE,
    "DPUF_RESPONSE_LOGPROBS": records_mod.RESPONSE_LOGPROBS,
    "DPUF_FEATURE_LOGPROBS": layout_mod.FEATURE_LOGPROBS,
    "DPUF_MAX_TOP_LOGPROBS": layout_mod.MAX_TOP_LOGPROBS,
    "DPUF_MIN_LOGPROBS_SLOT_SIZE": layout_mod.MIN_LOGPROBS_SLOT_SIZE,
    **{f"DPUF_FINISH_{r.name}": int(r) for r in FinishReason},
    "DPUF_MAILBOX_SIZE": MAILBOX.size, "DPUF_KERNEL_BLOCK_SIZE": KERNEL_BLOCK.size,
    # the model's record writer (record_writer.h, dpu_frontend/model/publish.py)
    "DPUF_WRITER_RESET_WORDS": publish_mod.RESET_WORDS,
    "DPUF_WRITER_FINAL_WORDS": publish_mod.FINAL_WORDS,
    "DPUF_WRITER_ARM_WORDS": publish_mod.ARM_WORDS, "DPUF_WRITER_ROW_WORDS": publish_mod.ROW_WORDS,
    "DPUF_WRITER_IGNORE_EOS": publish_mod.IGNORE_EOS, "DPUF_WRITER_LOGPROBS": publish_mod.LOGPROBS,
    "DPUF_WRITER_MAX_CHANNELS": publish_mod.MAX_CHANNELS,
    "DPUF_WRITER_MAX_EOS": publish_mod.MAX_EOS,
    **{f"DPUF_WRITER_{name}": code for code, name in (
        (1, "RING_FULL"), (2, "NO_LOGPROBS"), (3, "BAD_SLOT"))},
    # the scheduler inside the GPU (scheduler.h, sched_core.h, dpu_frontend/model/device/sched_core.py)
    **{f"DPUF_SAMPLER_{v.upper()}": i for i, v in enumerate(sampling.VARIANTS)},
    "DPUF_MODEL_VARIANTS": len(sampling.VARIANTS), "DPUF_MODEL_MAX_EOS": sched_core.MAX_EOS,
    **{f"DPUF_MODEL_ERR_{name}": code for code, name in (
        (1, "NO_GRAPH"), (2, "LAUNCH"), (3, "WRITER"))},
    "DPUF_SCHED_OK": sched_core.OK, "DPUF_SCHED_FULL": sched_core.FULL,
    "DPUF_SCHED_BAD_PROMPT": sched_core.BAD_PROMPT, "DPUF_SCHED_BAD_ENTRY": sched_core.BAD_ENTRY,
    "DPUF_SCHED_NO_GRAPH": sched_core.NO_GRAPH, "DPUF_SEQ_FREE": sched_core.SEQ_FREE,
    "DPUF_SEQ_WAITING": sched_core.SEQ_WAITING, "DPUF_SEQ_RUNNING": sched_core.SEQ_RUNNING,
    "DPUF_SCHED_MAX_CHANNELS": sched_core.MAX_CHANNELS,
    "DPUF_SCHED_MAX_GRAPHS": sched_core.MAX_GRAPHS,
}

#: The golden records: what the C program fills, field by field, and what the
#: Python encoders must produce for the same values.
PARAMS = SamplingParams(max_tokens=77, temperature=0.5, top_p=0.25, top_k=40, min_p=0.125,
                        seed=0x1122334455667788, presence_penalty=-1.5, frequency_penalty=2.0,
                        repetition_penalty=1.25, stop_token_ids=(7, 8, 151645),
                        ignore_eos=True, logprobs=3)
GOLDEN_C = r"""
static void golden(void) {
    dpuf_request g; memset(&g, 0, sizeof g);
    g.commit = 5; g.kind = DPUF_KIND_GENERATE;
    g.flags = DPUF_FLAG_IGNORE_EOS | DPUF_FLAG_HAS_SEED | DPUF_FLAG_LOGPROBS; g.top_logprobs = 3;
    g.request_id = 0xabcdef0123ull; g.arena_offset = 384; g.prompt_len = 33; g.max_tokens = 77;
    g.temperature = 0.5f; g.top_p = 0.25f; g.top_k = 40; g.min_p = 0.125f;
    g.seed = 0x1122334455667788ull; g.presence_penalty = -1.5f; g.frequency_penalty = 2.0f;
    g.repetition_penalty = 1.25f; g.n_stop_token_ids = 3; g.stop_token_ids[0] = 7;
    g.stop_token_ids[1] = 8; g.stop_token_ids[2] = 151645; g.epoch = 9;
    dump("generate", &g, sizeof g);
    g.commit = 7; g.flags |= DPUF_FLAG_CONSTRAINED; g.automaton_bytes = 116;
    dump("generate_constrained", &g, sizeof g);
    struct { dpuf_automaton h; int32_t words[13]; } a; memset(&a, 0, sizeof a);
    memcpy(a.h.magic, DPUF_AUTOMATON_MAGIC, 8); a.h.header_size = DPUF_AUTOMATON_HEADER_SIZE;
    a.h.vocab_size = 40; a.h.eos = 39; a.h.states = 2; a.h.list_len = 2; a.h.mask_words = 2;
    a.h.dense_states = 1; a.h.total_bytes = 116; a.h.key = 0x0102030405060708ull;
    int32_t words[13] = {0, 1, 2, 39, 39, 0, 1, 1, DPUF_AUTOMATON_NONE, 0, DPUF_AUTOMATON_NONE,
                         (int32_t)0xffffffffu, 0xbf};
    memcpy(a.words, words, sizeof words);
    dump("automaton", &a, 116);
    dpuf_request c; memset(&c, 0, sizeof c);
    c.commit = 6; c.kind = DPUF_KIND_CANCEL; c.request_id = 0xabcdef0123ull; c.epoch = 9;
    dump("cancel", &c, sizeof c);
    struct { dpuf_response_header h; uint32_t tokens[8]; } r; memset(&r, 0, sizeof r);
    r.h.seq = 12; r.h.request_id = 0xabcdef0123ull; r.h.epoch = 9; r.h.n_tokens = 3;
    r.h.finish = DPUF_FINISH_LENGTH; r.tokens[0] = 1; r.tokens[1] = 65536; r.tokens[2] = 151643;
    dump("response", &r, sizeof r);
    struct { dpuf_response_header h; dpuf_token_logprobs t[1]; uint8_t pad[16]; } l;
    memset(&l, 0, sizeof l);
    l.h.seq = 13; l.h.request_id = 0xabcdef0123ull; l.h.epoch = 9; l.h.n_tokens = 1;
    l.h.finish = DPUF_FINISH_NONE; l.h.flags = DPUF_RESPONSE_LOGPROBS; l.h.n_top = 2;
    l.t[0].token = 151643; l.t[0].logprob = -0.5f; l.t[0].top_ids[0] = 151643;
    l.t[0].top_logprobs[0] = -0.5f; l.t[0].top_ids[1] = 9; l.t[0].top_logprobs[1] = -1.25f;
    dump("response_logprobs", &l, sizeof l);
    dpuf_gpu_ctrl gc; memset(&gc, 0, sizeof gc);
    gc.resp_produced = 12; gc.req_consumed = 6; gc.heartbeat = 999; gc.epoch = 9;
    dump("gpu_ctrl", &gc, sizeof gc);
    dpuf_dpu_ctrl dc; memset(&dc, 0, sizeof dc); dc.resp_consumed = 10;
    dump("dpu_ctrl", &dc, sizeof dc);
}
"""


def _compiler() -> str:
    for cc in ("cc", "gcc", "clang"):
        if shutil.which(cc):
            return cc
    pytest.fail("no C compiler: deploy/dev.sh setup installs gcc")


def _program() -> str:
    lines = ['#include <stdio.h>', '#include <string.h>', '#include "peer_kernel.h"',
             '#include "record_writer.h"', '#include "scheduler.h"',
             'static int first = 1;',
             'static void key(const char *k) { printf("%s\\"%s\\": ", first ? "" : ", ", k); '
             'first = 0; }',
             'static void dump(const char *name, const void *p, size_t n) { key(name); '
             'printf("\\""); for (size_t i = 0; i < n; i++) printf("%02x", '
             '((const unsigned char *)p)[i]); printf("\\""); }',
             GOLDEN_C, "int main(void) {", 'printf("{");']
    for s in STRUCTS:
        lines.append(f'key("sizeof {s.c_name}"); printf("%zu", sizeof({s.c_name}));')
        for name in s.offsets:
            lines.append(f'key("{s.c_name}.{name}"); printf("%zu", offsetof({s.c_name}, {name}));')
    for c_name, mirror in CTYPES_MIRRORS.items():
        lines.append(f'key("sizeof {c_name}"); printf("%zu", sizeof({c_name}));')
        for name in (field[0] for field in mirror._fields_):  # (name, type) or (name, type, bits)
            lines.append(f'key("{c_name}.{name}"); printf("%zu", offsetof({c_name}, {name}));')
    for name in CONSTANTS:
        lines.append(f'key("{name}"); printf("%llu", (unsigned long long)({name}));')
    lines += ['key("magic"); printf("\\"%s\\"", DPUF_MAGIC);', "golden();",
              'printf("}\\n");', "return 0; }"]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def c_side(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    work = tmp_path_factory.mktemp("c_header")
    source, binary = work / "check.c", work / "check"
    source.write_text(_program())
    subprocess.run([_compiler(), "-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic",
                    *(f"-I{d}" for d in SCHEDULER.dirs), str(source), "-o", str(binary)], check=True)
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    result: dict[str, object] = json.loads(out)
    return result


@pytest.mark.parametrize("spec", STRUCTS, ids=lambda s: s.c_name)
def test_every_size_and_offset_matches(c_side: dict[str, object], spec: CStruct) -> None:
    assert c_side[f"sizeof {spec.c_name}"] == spec.size
    for name, offset in spec.offsets.items():
        assert c_side[f"{spec.c_name}.{name}"] == offset, name


@pytest.mark.parametrize("c_name", list(CTYPES_MIRRORS))
def test_the_launcher_mirrors_the_host_api(c_side: dict[str, object], c_name: str) -> None:
    mirror = CTYPES_MIRRORS[c_name]
    assert c_side[f"sizeof {c_name}"] == ctypes.sizeof(mirror)
    for name in (field[0] for field in mirror._fields_):  # (name, type) or (name, type, bits)
        assert c_side[f"{c_name}.{name}"] == getattr(mirror, name).offset, name


def test_constants_match(c_side: dict[str, object]) -> None:
    for name, value in CONSTANTS.items():
        assert c_side[name] == value % 2**64, name  # printed as unsigned
    assert str(c_side["magic"]).encode() == layout_mod.MAGIC
    assert list(COUNTERS) == [n for n, _ in MAILBOX.fields][6:]


#: Two states over 40 tokens: state 0 dense (tokens 0-37 go to state 1, its default; 38
#: is not allowed; the end token 39 is listed, back to state 0), state 1 sparse (the end
#: token only).
GOLDEN_AUTOMATON = TokenAutomaton(
    vocab_size=40, eos=39, list_start=array("i", [0, 1, 2]), list_tokens=array("i", [39, 39]),
    list_next=array("i", [0, 1]), default_next=array("i", [1, NONE]),
    mask_at=array("i", [0, NONE]), masks=array("I", [0xFFFF_FFFF, 0xBF]))


def _golden_python() -> dict[str, bytes]:
    generate = GenerateRecord(0xabcdef0123, 384, 33, PARAMS)
    constrained = GenerateRecord(0xabcdef0123, 384, 33, PARAMS, automaton_bytes=116)
    cancel = CancelRecord(0xabcdef0123)
    response = ResponseRecord(0xabcdef0123, (1, 65536, 151643), FinishReason.LENGTH)
    with_logprobs = ResponseRecord(0xabcdef0123, (151643,), FinishReason.NONE,
                                   (TokenLogprobs(-0.5, ((151643, -0.5), (9, -1.25))),))
    return {
        "generate": records_mod.COMMIT.pack(5) + records_mod.encode_request_body(generate, 9),
        "generate_constrained": records_mod.COMMIT.pack(7)
        + records_mod.encode_request_body(constrained, 9),
        "automaton": encode_automaton(GOLDEN_AUTOMATON, 0x0102030405060708),
        "cancel": records_mod.COMMIT.pack(6) + records_mod.encode_request_body(cancel, 9),
        "response": records_mod.COMMIT.pack(12) + records_mod.encode_response_body(response, 64, 9),
        "response_logprobs": records_mod.COMMIT.pack(13)
        + records_mod.encode_response_body(with_logprobs, 96, 9),
        "gpu_ctrl": GPU_CTRL_STRUCT.pack(12, 6, 999, 9),
        "dpu_ctrl": DPU_CTRL_STRUCT.pack(10),
    }


#: The golden bytes themselves (checked by the C compiler when they were written),
#: so that a change of either side shows here too.
GOLDEN = json.loads((Path(__file__).parent / "golden_records.json").read_text())


@pytest.mark.parametrize("name", ["generate", "generate_constrained", "automaton", "cancel",
                                  "response", "response_logprobs", "gpu_ctrl", "dpu_ctrl"])
def test_golden_records_are_byte_identical(c_side: dict[str, object], name: str) -> None:
    python = _golden_python()[name]
    assert c_side[name] == python.hex() == GOLDEN[name]


def test_the_layout_record_matches_the_c_structs() -> None:
    layout = Geometry(channels=2).plan(instance=0x55)
    data = layout.encode()
    header = HEADER_STRUCT.unpack_from(data)
    assert header[0] == layout_mod.MAGIC and header[1] == 2
    for i, ch in enumerate(layout.channels):
        values = CHANNEL_STRUCT.unpack_from(data, HEADER_STRUCT.size + i * CHANNEL_STRUCT.size)
        assert dict(zip([n for n, _ in CHANNEL_STRUCT.fields], values, strict=True)) == {
            n: getattr(ch, n) for n, _ in CHANNEL_STRUCT.fields}


@pytest.mark.parametrize("sources", [PEER_SOURCES, RECORDS, SCHEDULER, SCHED_HOST, WALK_HOST,
                                     ALLREDUCE, ALLREDUCE_HOST, STEP_RELAY_HOST],
                         ids=lambda s: s.library)
def test_the_sources_are_package_data(sources: CudaSources) -> None:
    """Every file a library is built from is where it says, and a wheel ships it; the
    files it declares are exactly what its main file includes, directly or not (the
    build cache is named by their hash: a file left out would leave a stale build)."""
    included, todo = set(), [sources.main]
    while todo:
        name = todo.pop()
        if name not in included:
            included.add(name)
            todo += re.findall(r'^#include "([^"]+)"', sources.path(name).read_text(), re.M)
    assert included == {sources.main, *sources.includes}
    root = Path(dpu_frontend.__file__).parent
    package_data = tomllib.loads((root.parent / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["dpu_frontend"]
    for path in sources.files():
        relative = path.relative_to(root).as_posix()
        assert any(fnmatch.fnmatch(relative, glob) for glob in package_data), relative


#: Rows around every edge of the sampler's rules: temperature, top_p, min_p, presence,
#: frequency, repetition (float32, as the request record carries them) and top_k.
RULE_ROWS = [(t, p, m, pr, fr, rep, k)
             for t in (0.0, 9e-6, 1e-5, 1.1e-5, 1.0)
             for p, m, k in ((1.0, 0.0, 0), (0.999, 0.0, 0), (1.0, 1e-7, 0), (1.0, 0.0, 1))
             for pr, fr, rep in ((0.0, 0.0, 1.0), (-0.0, 0.0, 1.0), (1e-7, 0.0, 1.0),
                                 (0.0, -2.0, 1.0), (0.0, 0.0, 1.0000001))]


def test_the_sampler_rules_are_the_same_in_c_and_python(tmp_path: Path) -> None:
    """scheduler.h's DPUF_GREEDY_BELOW, DPUF_ROW_* and DPUF_SAMPLER_VARIANT, evaluated by
    the C compiler on every edge case and every combination of facts, against
    ``sampling``'s rules: the GPU scheduler picks a batch's sampler graph by the same
    rule the host path skips stages by."""
    rows = "\n".join(
        f"{{ float t = {t!r}f, p = {p!r}f, m = {m!r}f, pr = {pr!r}f, fr = {fr!r}f, "
        f"rep = {rep!r}f; long long k = {k}; printf(\"%d %d %d\\n\", DPUF_ROW_GREEDY(t) ? 1 : 0, "
        "DPUF_ROW_PENALIZED(pr, fr, rep) ? 1 : 0, DPUF_ROW_CUT(k, p, m) ? 1 : 0); }"
        for t, p, m, pr, fr, rep, k in RULE_ROWS)
    program = "\n".join([
        "#include <stdio.h>", "#include <string.h>", '#include "scheduler.h"', "int main(void) {",
        "float below = DPUF_GREEDY_BELOW; unsigned int bits; memcpy(&bits, &below, 4);",
        'printf("%08x\\n", bits);',
        "for (int f = 0; f < 32; f++)",
        '    printf("%u\\n", (unsigned)DPUF_SAMPLER_VARIANT(f & 1, f >> 1 & 1, f >> 2 & 1, f >> 3 & 1,'
        ' f >> 4 & 1));',
        rows, "return 0; }"])
    source, binary = tmp_path / "rules.c", tmp_path / "rules"
    source.write_text(program)
    subprocess.run([_compiler(), "-std=c11", "-Wall", "-Wextra", "-Werror",
                    *(f"-I{d}" for d in SCHEDULER.dirs), str(source), "-o", str(binary)], check=True)
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split("\n")
    assert out[0] == np.float32(sampling.GREEDY_BELOW).view(np.uint32).item().to_bytes(4, "big").hex()
    for f in range(32):
        facts = (bool(f & 1), bool(f >> 1 & 1), bool(f >> 2 & 1), bool(f >> 3 & 1),
                 bool(f >> 4 & 1))
        assert int(out[1 + f]) == sampling.variant_of(*facts), facts
    for i, (t, p, m, pr, fr, rep, k) in enumerate(RULE_ROWS):
        f32 = [np.array([x], np.float32) for x in (t, p, m, pr, fr, rep)]
        python = (int(sampling.row_greedy(f32[0])[0]),
                  int(sampling.row_penalized(f32[3], f32[4], f32[5])[0]),
                  int(sampling.row_cut(np.array([k], np.int64), f32[1], f32[2])[0]))
        assert tuple(map(int, out[33 + i].split())) == python, RULE_ROWS[i]


@pytest.mark.parametrize(("binding", "sources", "header"), [
    (PeerLibrary, PEER_SOURCES, "peer_kernel.h"),
    (SchedulerLibrary, SCHEDULER, "scheduler.h"),
    (WriterLibrary, RECORDS, "record_writer.h"),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_every_function_a_binding_calls_is_declared(binding: type[CudaLibrary],
                                                    sources: CudaSources, header: str) -> None:
    """The ctypes tables name functions of their library's header (CI cannot build the
    library itself: a misspelt name would fail only when a GPU machine loads it)."""
    declared = sources.path(header).read_text()
    for name in binding.api():
        assert re.search(rf"\b{name}\(", declared), f"{name} is not declared in {header}"
