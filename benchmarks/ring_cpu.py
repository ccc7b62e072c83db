"""CPU cost per token of the daemon's response path, over the shm twin.

The GPU half fills the response ring with records of the default geometry
(8 tokens each); the daemon half polls and decodes them (the work the poll
loop does per productive poll: the control block, the speculative window,
exact reads past it), then the detokenizer turns them into text.
Beside each figure, the bare limit measured in the same run:

* ring: copying the same record bytes out of the region (the READ alone);
* detokenize: ``DecodeStream.step`` alone on the same ids, a record's ids per call.

    python -m benchmarks.ring_cpu
"""

from __future__ import annotations

import argparse
import mmap
from collections.abc import Callable

from tokenizers.decoders import DecodeStream

from benchmarks.common import best_of, record
from dpu_frontend.ring import DpuChannel, FinishReason, Geometry, GpuChannel, ResponseRecord
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.detokenizer import IncrementalDetokenizer
from dpu_frontend.text.tokenizer import Vocabulary

CORPUS = ("The request ring is a row of fixed slots in GPU memory. 日本語の文章 and emoji 🚀 "
          "travel through it as token ids, ten to a record. ") * 40


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200, help="full rings per measurement")
    args = parser.parse_args()

    vocab = Vocabulary.load(default_tokenizer_dir())
    ids = vocab.encode(CORPUS)
    geometry = Geometry()
    layout = geometry.plan(instance=1)
    ch = layout.channels[0]
    region = mmap.mmap(-1, layout.region_size)
    memory = AtomicMemory(region)
    per = ch.tokens_per_response
    records = [ResponseRecord(1 + i % 8, tuple(ids[(i * per) % (len(ids) - per):][:per]),
                              FinishReason.NONE) for i in range(ch.resp_slots)]
    tokens_per_round = sum(len(r.tokens) for r in records)

    # The GPU half publishes one full ring once; every round the daemon half reads and
    # decodes all of it afresh (a new DpuChannel), so the peer's own cost stays out.
    gpu = GpuChannel(memory, ch)
    gpu.reset(1)
    assert gpu.publish(records) == len(records)

    def poll_once() -> None:
        dpu = DpuChannel(ch, epoch=1)
        poll = dpu.begin_poll()
        data = [region[r.offset:r.offset + r.length] for r in poll.reads]
        _, more = dpu.end_poll(poll, data, 0.0)
        for r in more:
            dpu.on_records(r, region[r.offset:r.offset + r.length])

    def copy_once() -> None:
        dpu = DpuChannel(ch, epoch=1)
        poll = dpu.begin_poll()
        for r in poll.reads:
            region[r.offset:r.offset + r.length]
        dpu.on_ctrl(region[ch.gpu_ctrl_offset:ch.gpu_ctrl_offset + 32], 0.0)
        for r in dpu._follow_up_reads():  # the records' bytes, not decoded: the READs alone
            region[r.offset:r.offset + r.length]

    def rounds(step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(args.rounds):
                step()
        return run

    ring = best_of(rounds(poll_once))
    bare = best_of(rounds(copy_once))

    stream_ids = ids * 4

    def detok() -> None:
        d = IncrementalDetokenizer(vocab)
        for i in range(0, len(stream_ids), per):
            d.push(stream_ids[i:i + per])
        d.finish()

    def decode_stream() -> None:
        ds = DecodeStream(skip_special_tokens=True)
        for i in range(0, len(stream_ids), per):  # a record's ids per call, as the daemon does
            ds.step(vocab.tokenizer, stream_ids[i:i + per])

    detok_s = best_of(detok)
    step_s = best_of(decode_stream)
    n_ring = args.rounds * tokens_per_round
    record("ring_cpu", {
        "ring poll+decode ns/token": round(ring / n_ring * 1e9, 1),
        "bare limit: same polls, copy only, ns/token": round(bare / n_ring * 1e9, 1),
        "detokenize ns/token": round(detok_s / len(stream_ids) * 1e9, 1),
        "bare limit: DecodeStream.step per record, ns/token":
            round(step_s / len(stream_ids) * 1e9, 1),
        "tokens per record": per,
    })
    memory.release()
    region.close()


if __name__ == "__main__":
    main()
