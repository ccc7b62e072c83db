"""``dpu-frontend demo``: peer + daemon + one streamed completion, printed as it arrives.

Run it under ``dpu-frontend softroce`` for the verbs transport. The HTTP
request is made from the same host (inside the micro-VM when there is one),
as ``curl -N`` would make it, and every SSE line is printed as it arrives.
"""

from __future__ import annotations

import json
import os
import urllib.request

from dpu_frontend.softroce.harness import RXE_IP
from dpu_frontend.softroce.processes import CLI, DAEMON_READY, PEER_READY, start, stop

MODEL = "qwen3"
READY_TIMEOUT_S = 600  # tokenizer loading under the VM's emulated CPU takes seconds


def run_demo(*, transport: str, rdma_ip: str | None, prompt: str, max_tokens: int,
             port: int) -> int:
    if transport == "verbs":
        host = rdma_ip or RXE_IP
        net = ["--rdma-ip", host]
    else:
        host = "127.0.0.1"
        net = ["--shm-path", f"/dev/shm/dpu-frontend-demo-{os.getpid()}"]
    peer, address = start([*CLI, "peer", "--transport", transport, *net, "--host", host,
                           "--port", "0"], PEER_READY, READY_TIMEOUT_S)
    procs = [peer]
    try:
        serve_net = net if transport == "verbs" else []
        daemon, base = start([*CLI, "serve", "--transport", transport, *serve_net,
                              "--peer", address, "--port", str(port), "--model-name", MODEL],
                             DAEMON_READY, READY_TIMEOUT_S)
        procs.append(daemon)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        url = f"{base}/v1/completions"
        print(f"$ curl -N {url} -H 'Content-Type: application/json' -d '{json.dumps(body)}'",
              flush=True)
        request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        text = []
        with urllib.request.urlopen(request, timeout=120) as resp:
            for raw in resp:
                line = raw.decode().rstrip("\n")
                if line:
                    print(line, flush=True)
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    text += [c["text"] for c in chunk.get("choices", [])]
        print(f"\ncompletion over {transport}: {''.join(text)!r}", flush=True)
        return 0
    finally:
        for proc in reversed(procs):
            stop(proc)
