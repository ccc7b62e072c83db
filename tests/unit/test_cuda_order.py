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
SCHED_CONSUMED = ("        __threadfence_system();\n"
                  "        dpuf_store_release_sys(&gpu_ctrl_of(a.region, d)->req_consumed, seq - 1);\n")
PEER_CONSUMED = ("            __threadfence_system();\n"
                 "            dpuf_store_release_sys(&gpu_ctrl_of(a.region, d)->req_consumed, seq - 1);\n")
PEER_EPOCH = "        dpuf_store_release_sys(&gpu_ctrl_of(a.region, d)->epoch, new_epoch);\n"
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
    "req_consumed at the commit (scheduler)": ("scheduler.cu", [
        (SCHED_CONSUMED, ""),
        ("            sm.verdict = read_request(a.region, d, st->epoch, seq, sm.words);\n",
         "            sm.verdict = read_request(a.region, d, st->epoch, seq, sm.words);\n"
         "            if (sm.verdict != V_NONE) {\n"
         "                __threadfence_system();\n"
         "                dpuf_store_release_sys(&gpu_ctrl_of(a.region, d)->req_consumed, seq);\n"
         "            }\n")],
        "req_consumed stored before the record or its prompt is read"),
    "req_consumed at the commit (CUDA peer)": ("peer_kernel.cu", [
        (PEER_CONSUMED, ""),
        ("            sm->action = read_record(a, c, seq, sm);\n",
         "            sm->action = read_record(a, c, seq, sm);\n"
         "            __threadfence_system();\n"
         "            dpuf_store_release_sys(&gpu_ctrl_of(a.region, d)->req_consumed, seq);\n")],
        "req_consumed stored before the record or its prompt is read"),
    "req_consumed before the block's copy is done": ("scheduler.cu", [
        ("            copy_prompt((const uint32_t *)(a.region + d->arena_offset + "
         "req_u64(sm.words, REQ_ARENA)), dst, len);\n",
         "            copy_prompt((const uint32_t *)(a.region + d->arena_offset + "
         "req_u64(sm.words, REQ_ARENA)), dst, len);\n" + SCHED_CONSUMED.replace("seq - 1", "seq"))],
        "req_consumed stored with no __syncthreads() after the prompt copy"),
    "epoch before the reset": ("peer_kernel.cu", [
        (PEER_EPOCH, ""),
        ("    reset_rings(a.region, d);\n", PEER_EPOCH + "    reset_rings(a.region, d);\n")],
        "epoch stored where no ring is reset"),
    "epoch without the fence after the reset": ("scheduler.cu", [
        ("        /* Every zero reaches the system before the new epoch does. */\n"
         "        __threadfence_system();\n", "")],
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
    "a release the rules do not know": ("peer_kernel.cu", [
        (PEER_EPOCH, PEER_EPOCH + "        dpuf_store_release_sys(&st->acked, 0);\n")],
        "release of an unknown target"),
}


def test_the_kernels_keep_every_rule() -> None:
    assert violations(SOURCES) == []


def test_every_rule_has_releases_to_check() -> None:
    """The CUDA peer and the model's scheduler each take requests and reset channels; the
    peer and the record writer each publish: if a refactor hid one, the rules would
    have nothing left to hold."""
    found = {kind: sorted(names) for kind, names in releases(SOURCES).items()}
    assert found["seq"] == ["publish_round", "serve_entry"]
    assert found["resp_produced"] == ["finish_step", "writer_run"]
    assert found["req_consumed"] == ["intake", "intake_channel"]
    assert found["epoch"] == ["reset_channel", "run_mailbox"]
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
