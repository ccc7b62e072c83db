"""The model peer's host work per engine step, without a GPU.

What the host does for every step of the host-driven model peer apart from the
GPU's own work: the engine's scheduler and stop rules (``ModelEngine``, over
the stand-in runner of ``tests/model/test_engine.py``, whose draws cost about a
microsecond a sequence), the hand-over of each token to its channel
(``EngineHub.deliver``), the records built from them (``ModelSource.step``)
and their publication in a response ring (``GpuChannel.publish``). ``--seqs``
sequences decode one token a step, none ending; ``--waiting`` more wait for a
slot (as at saturation, where requests queue in the engine). The bare limit beside it:
publishing the same number of prebuilt records, the least a host-driven peer
does per step. The runner's own host work (the step's metadata, the sampling
parameters, the launches) needs a GPU: ``benchmarks.model_serving`` reports
it as ``launch``.

    python -m benchmarks.peer_host --seqs 256 --waiting 750
"""

from __future__ import annotations

import argparse
import mmap
import time

from benchmarks.common import best_of, record
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.model.options import EngineOptions
from dpu_frontend.model.source import EngineHub, ModelSource
from dpu_frontend.peer.reference import RecordSpace
from dpu_frontend.ring import (
    FinishReason,
    GenerateRecord,
    Geometry,
    GpuChannel,
    ResponseRecord,
    SamplingParams,
)
from dpu_frontend.ring.memory import AtomicMemory
from tests.model.test_engine import FakeRunner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--waiting", type=int, default=0, help="sequences queued for a slot")
    ap.add_argument("--steps", type=int, default=200, help="steps per measurement")
    args = ap.parse_args(argv)

    layout = Geometry(resp_slots=max(4096, 2 * args.seqs),
                      max_sequences=max(1024, args.seqs + args.waiting)).plan(instance=1)
    ch = layout.channels[0]
    region = mmap.mmap(-1, layout.region_size)
    memory = AtomicMemory(region)
    ring = GpuChannel(memory, ch)
    ring.reset(1)

    engine = ModelEngine(ModelConfig.default(), FakeRunner(1 << 16, args.seqs, 1 << 20),  # type: ignore[arg-type]
                         EngineOptions(max_batched_tokens=4096))
    hub = EngineHub(engine)
    source = ModelSource(hub, RecordSpace(ch.tokens_per_response, ch.logprob_tokens_per_response))
    params = SamplingParams(max_tokens=1 << 19, ignore_eos=True, temperature=0.0)
    for i in range(args.seqs + args.waiting):
        source.admit(GenerateRecord(i, 0, 1, params), (5,) * 64, 0.0)
    for _ in range(3):  # prefill, then decoding
        hub.deliver(engine.step())
        ring.publish(source.step(0.0, ch.resp_slots))

    spent = {"engine": 0.0, "records": 0.0, "publish": 0.0}

    def steps() -> None:
        for _ in range(args.steps):
            a = time.perf_counter()
            events = engine.step()
            b = time.perf_counter()
            hub.deliver(events)
            out = source.step(0.0, ch.resp_slots)
            c = time.perf_counter()
            ring.reset(ring.epoch + 1)  # the daemon's side is not here: start the ring afresh
            d = time.perf_counter()
            if ring.publish(out) != len(out):
                raise RuntimeError("the response ring is too small for a step's records")
            e = time.perf_counter()
            spent["engine"] += b - a
            spent["records"] += c - b
            spent["publish"] += e - d

    total = best_of(steps, repeat=3) / args.steps
    calls = 3 * args.steps
    prebuilt = [ResponseRecord(i, (7,), FinishReason.NONE) for i in range(args.seqs)]

    def bare() -> None:
        for _ in range(args.steps):
            ring.reset(ring.epoch + 1)
            ring.publish(prebuilt)

    def resets() -> None:
        for _ in range(args.steps):
            ring.reset(ring.epoch + 1)

    reset = best_of(resets) / args.steps
    bare_s = best_of(bare) / args.steps - reset
    per_seq = 1e6 / args.seqs
    record("peer_host", {
        "sequences": args.seqs, "waiting for a slot": args.waiting,
        "host work per step, ms (best)": round((total - reset) * 1e3, 3),
        "  engine: schedule, stand-in runner, stop rules, us/sequence":
            round(spent["engine"] / calls * per_seq, 2),
        "  deliver + records, us/sequence": round(spent["records"] / calls * per_seq, 2),
        "  publish, us/sequence": round(spent["publish"] / calls * per_seq, 2),
        "bare limit: publish prebuilt records, us/sequence": round(bare_s * per_seq, 2),
    })
    memory.release()
    region.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
