"""``dpu-frontend demo``: peer + daemon + one streamed completion, printed as it arrives.

Run it under ``dpu-frontend softroce`` for the verbs transport. The HTTP
request is made from the same host (inside the micro-VM when there is one),
exactly as ``curl -N`` would make it, and every SSE line is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from dpu_frontend.softroce.harness import RXE_IP

MODEL = "qwen3"
PEER_PORT = 18515


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "dpu_frontend.cli", *args])


def wait_healthy(base: str, procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"daemon not healthy after {timeout}s")


def run_demo(*, transport: str, rdma_ip: str | None, prompt: str, max_tokens: int,
             port: int) -> int:
    if transport == "verbs" and rdma_ip is None:
        rdma_ip = RXE_IP
    rdma = ["--rdma-ip", rdma_ip] if transport == "verbs" and rdma_ip else []
    host = rdma_ip if transport == "verbs" and rdma_ip else "127.0.0.1"
    shm = ["--shm-path", f"/dev/shm/dpu-frontend-demo-{os.getpid()}"]
    peer = _spawn("peer", "--transport", transport, *rdma, "--host", host,
                  "--port", str(PEER_PORT), *(shm if transport == "shm" else []))
    procs = [peer]
    try:
        time.sleep(0.5)
        procs.append(_spawn("serve", "--transport", transport, *rdma,
                            "--peer", f"{host}:{PEER_PORT}", "--port", str(port),
                            "--model-name", MODEL))
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, procs, timeout=300)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        print(f"$ curl -N {base}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{json.dumps(body)}'", flush=True)
        request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        text = []
        with urllib.request.urlopen(request, timeout=120) as resp:
            for raw in resp:
                line = raw.decode().rstrip("\n")
                if line:
                    print(line, flush=True)
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    text += [c["text"] for c in chunk.get("choices", [])]
        print(f"\ncompletion over {transport}: {''.join(text)!r}", flush=True)
        return 0
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
