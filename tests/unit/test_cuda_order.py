"""The CUDA kernels keep the protocol's memory order (``cuda_order.py`` reads it from the
sources), and each reordering below, made in a copy of the real source, is caught."""

from __future__ import annotations

import pytest

from .cuda_order import device_sources, releases, violations

SOURCES = device_sources()

#: The release of a response record's seq in each publisher, and their bodies' last store.
PEER_SEQ = "        dpuf_store_release_sys((volatile uint64_t *)slot, p + 1);\n"
PEER_SLOT = "    uint8_t *slot = a.region + dpuf_resp_slot_offset(d, p);\n"
WRITER_SEQ = ("        __threadfence_system();\n"
              "        dpuf_store_release_sys((volatile uint64_t *)slot, p + 1);\n")
#: The intake walk and the mailbox command both kernels share (ring_device.cuh).
CONSUMED = ("        __threadfence_system();\n"
            "        dpuf_store_release_sys(&gpu_ctrl_of(region, d)->req_consumed, seq - 1);\n")
READ = "            uint32_t verdict = read_request(region, d, st->epoch, seq, sm.words);\n"
COPY = ("            copy_prompt((const uint32_t *)(region + d->arena_offset + req_u64(sm.words, "
        "REQ_ARENA)), k.prompt(entry),\n                        sm.words[REQ_PROMPT_LEN]);\n")
EPOCH = "            dpuf_store_release_sys(&gpu_ctrl_of(region, d)->epoch, epoch);\n"
FENCED_EPOCH = ("         * DPU that sees the epoch sees clean rings and counters. */\n"
                "        __threadfence_system();\n")
PEER_PRODUCED = "dpuf_store_release_sys(&gpu_ctrl_of(a.region, d)->resp_produced, produced);"
ACK = "    dpuf_store_release_sys(&mb->ack_seq, command_seq);\n"

#: name: (file, [(old, new), ...] applied in order, what the check must say)
MUTATIONS: dict[str, tuple[str, list[tuple[str, str]], str]] = {
    "seq before the body": ("peer_kernel.cu", [
        (PEER_SEQ, ""), (PEER_SLOT, PEER_SLOT + PEER_SEQ)],
        "a store to the slot after its seq release"),
    "seq without its fence": ("record_writer.cuh", [
        (WRITER_SEQ, "        dpuf_store_release_sys((volatile uint64_t *)slot, p + 1);\n")],
        "seq released without a __threadfence_system()"),
    "lane 0 publishes before the warp meets": ("peer_kernel.cu", [
        ("    __threadfence_system();\n    __syncwarp();\n", "    __threadfence_system();\n")],
        "seq released by one thread with no barrier"),
    "req_consumed at the commit": ("ring_device.cuh", [
        (CONSUMED, ""),
        (READ, READ + "            if (verdict != V_NONE) {\n"
                      "                __threadfence_system();\n"
                      "                dpuf_store_release_sys(&gpu_ctrl_of(region, d)->req_consumed, seq);\n"
                      "            }\n")],
        "req_consumed stored before the record or its prompt is read"),
    "req_consumed before the block's copy is done": ("ring_device.cuh", [
        (COPY, COPY + CONSUMED.replace("seq - 1", "seq"))],
        "req_consumed stored with no __syncthreads() after the prompt copy"),
    "epoch before the reset": ("ring_device.cuh", [
        (EPOCH, ""),
        ("        reset_rings(region, d);\n", EPOCH + "        reset_rings(region, d);\n")],
        "epoch stored where no ring is reset"),
    "epoch without the fence after the reset": ("ring_device.cuh", [
        (FENCED_EPOCH, FENCED_EPOCH.removesuffix("        __threadfence_system();\n"))],
        "epoch stored without a fence and a __syncthreads() after the reset"),
    "resp_produced without its fence": ("peer_kernel.cu", [
        ("                __threadfence_system(); /* the records' seq words before the index */\n", "")],
        "resp_produced released without a __threadfence_system()"),
    "resp_produced with a plain store": ("peer_kernel.cu", [
        (PEER_PRODUCED, PEER_PRODUCED.replace("dpuf_store_release_sys", "store_vol_u64"))],
        "resp_produced stored with a plain store"),
    "resp_consumed without acquire": ("record_writer.cuh", [
        ("sm.consumed[c] = dpuf_load_acquire_sys(", "sm.consumed[c] = load_vol_u64(")],
        "resp_consumed read without an acquire load"),
    "the commit word without acquire": ("ring_device.cuh", [
        ("if (dpuf_load_acquire_sys((const volatile uint64_t *)slot) != seq)",
         "if (load_vol_u64(slot) != seq)")],
        "the body loaded before the commit word's acquire load"),
    "a cached load of the body": ("ring_device.cuh", [
        ("const uint2 head = __ldcv((const uint2 *)(slot + 8));",
         "const uint2 head = *(const uint2 *)(slot + 8);")],
        "slot read without a fresh load"),
    "a cached load of the prompt": ("ring_device.cuh", [
        ("if (i < n4) v[k] = __ldcv(src4 + i);", "if (i < n4) v[k] = src4[i];")],
        "src4 read without a fresh load"),
    "the ack before the answer": ("ring_device.cuh", [
        (ACK, ""),
        ("    store_vol_u32(&mb->error, error);\n", ACK + "    store_vol_u32(&mb->error, error);\n")],
        "ack_seq released before the state or error it acknowledges"),
    "a release the rules do not know": ("ring_device.cuh", [
        (EPOCH, EPOCH + "            dpuf_store_release_sys(&st->acked, 0);\n")],
        "release of an unknown target"),
}


def test_the_kernels_keep_every_rule() -> None:
    assert violations(SOURCES) == []


def test_every_rule_has_releases_to_check() -> None:
    """The CUDA peer and the model's scheduler take requests and reset channels through
    the ring's shared walk and mailbox command; the peer and the record writer each
    publish: if a refactor hid one, the rules would have nothing left to hold."""
    found = {kind: sorted(names) for kind, names in releases(SOURCES).items()}
    assert found["seq"] == ["publish_round", "serve_entry"]
    assert found["resp_produced"] == ["finish_step", "writer_run"]
    assert found["req_consumed"] == ["intake_walk"]
    assert found["epoch"] == ["mailbox_command"]
    assert found["ack_seq"] == ["mailbox_ack"]


@pytest.mark.parametrize("name", MUTATIONS, ids=lambda name: name.replace(" ", "-"))
def test_each_reordering_in_the_source_is_caught(name: str) -> None:
    file, edits, expected = MUTATIONS[name]
    text = SOURCES[file]
    for old, new in edits:
        assert text.count(old) == 1, f"the mutation no longer applies: {old!r}"
        text = text.replace(old, new)
    found = violations({file: text})
    assert any(expected in v for v in found), found
