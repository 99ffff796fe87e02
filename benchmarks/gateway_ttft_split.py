"""Where a prefix-hit request's time to first token goes, on a prompt the cache holds whole (one
token left to read): the same request REPEATS times through the gateway and through the client
library alternately (the daemon's own `ttft_s` from each `done`), then through mlx_lm.server on
the same checkpoint. Prints the medians: engine, client library, gateway, mlx_lm.server.

    .venv/bin/python benchmarks/gateway_ttft_split.py daemon/model/demo_model 700
    .venv/bin/python benchmarks/gateway_ttft_split.py /tmp/prefix-bench/qwen3_5_moe-h256 1500
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from mlx_lm.utils import load_tokenizer

from moed.client import Client
from moed.client.events import DoneEvent, TokenEvent
from moed.daemon.bench.agent import (
    MoedSide,
    make_conversation,
    start_mlx_lm_server,
    stream_completion,
)

REPEATS = 24


def main() -> None:
    model = Path(sys.argv[1])
    system_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
    tok = load_tokenizer(model)
    conv = make_conversation(tok, system_tokens, 6, 40, 16, 1)
    prompt = conv.system + "".join(conv.users[:5])
    run_dir = Path(tempfile.mkdtemp(prefix="gateway-split-"))
    side = MoedSide("resident", model, run_dir, ("--resident",))
    side.start()
    gateway, client, engine = [], [], []
    try:
        with httpx.Client() as http:
            model_id = http.get(f"{side.url}/v1/models").json()["data"][0]["id"]
            for i in range(REPEATS):
                if i % 2:
                    gateway.append(stream_completion(http, side.url, model_id, prompt, 2).ttft_s)
                    continue
                with Client(side.socket, timeout=60) as c:
                    t0, first = time.perf_counter(), None
                    for ev in c.generate(prompt, raw=True, max_tokens=2, temperature=0.0):
                        if isinstance(ev, TokenEvent) and ev.text and first is None:
                            first = time.perf_counter() - t0
                        if isinstance(ev, DoneEvent):
                            client.append(first)
                            engine.append(ev.timings["ttft_s"])
    finally:
        side.stop()
    proc, url = start_mlx_lm_server(model, run_dir / "mlx_lm.log", 256)
    peer = []
    try:
        with httpx.Client() as http:
            for _ in range(REPEATS // 2 + 2):
                peer.append(stream_completion(http, url, None, prompt, 2).ttft_s)
    finally:
        proc.terminate()
        proc.wait(30)

    def ms(v: list) -> str:
        return f"{statistics.median(v[2:]) * 1e3:.1f} ms"  # the first two warm up

    tokens = len(tok.encode(prompt))
    print(f"time to first token of a fully cached prompt ({tokens} tokens), medians:")
    print(f"  engine (daemon's ttft_s) {ms(engine)}, client library {ms(client)}, ", end="")
    print(f"gateway {ms(gateway)}, mlx_lm.server {ms(peer)}")


if __name__ == "__main__":
    main()
