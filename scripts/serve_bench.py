#!/usr/bin/env python3
"""Aggregate tokens/s and time to first token of pp_node --serve at several concurrencies (standard library only).

    scripts/serve_bench.py --url http://127.0.0.1:8080 --concurrency 1,2,4,8 --tokens 64 --prompt-len 32

Each of N clients streams one /v1/completions request at once (token-id prompt, temperature 0,
ignore_eos, so every request generates exactly --tokens tokens). Aggregate tokens/s = all generated
tokens / wall time from the first request sent to the last [DONE]; TTFT = first streamed token.
"""
import argparse
import json
import statistics
import threading
import time
import urllib.request


def one(url, prompt, tokens, out, i):
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "return_tokens": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    first = None
    n = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            got = len(chunk["choices"][0].get("tokens", [])) if chunk["choices"] else 0
            if got and first is None:
                first = time.monotonic() - t0
            n += got
    out[i] = (n, first, time.monotonic() - t0)


def run(url, n, tokens, prompt_len, salt):
    prompts = [[1000 + (salt * 131 + i * 7919 + j * 104729) % 100000 for j in range(prompt_len)] for i in range(n)]
    out = [None] * n
    threads = [threading.Thread(target=one, args=(url, prompts[i], tokens, out, i)) for i in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    total = sum(o[0] for o in out)
    ttft = [o[1] for o in out]
    return total / wall, statistics.median(ttft), max(ttft), total, wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    run(a.url, 1, 4, 8, 0)  # warm-up
    print(f"{'clients':>7} {'tok/s':>8} {'ttft p50 ms':>12} {'ttft max ms':>12} {'tokens':>7} {'wall s':>7}")
    for rep in range(a.repeat):
        for n in [int(x) for x in a.concurrency.split(",")]:
            tps, t50, tmax, total, wall = run(a.url, n, a.tokens, a.prompt_len, rep * 10 + n)
            print(f"{n:>7} {tps:>8.2f} {t50 * 1e3:>12.1f} {tmax * 1e3:>12.1f} {total:>7} {wall:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
