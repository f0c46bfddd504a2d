#!/usr/bin/env python3
"""Throughput, latency and stage load of pp_node --serve at several concurrencies (standard library only).

    scripts/serve_bench.py --url http://127.0.0.1:8080 [--concurrency 1,2,4,8,16] [--tokens 64]
                           [--prompt-len 32] [--long-prompt 512] [--markdown]
    scripts/serve_bench.py --suite --pp-node build/pp_node --model M [--configs single,2-stage-shared,...]
                           [--threads-shared T] [--ctx C] [--parallel P] [same options as above]

--url benchmarks a server someone already started. --suite starts each configuration itself, in turn,
on ephemeral ports (worker `--port 0`, server `--http-port 0`), waits for /health, measures, stops it
(SIGTERM) and moves on; every child is killed on an error or Ctrl-C:

  single           pp_node --model M --serve --parallel P                        (all cores)
  2-stage shared   pp_node --worker (all cores) + pp_node --coordinator --cuts auto (all cores)
  single pinned    taskset -c 0 pp_node --model M --serve --threads 1
  2-stage pinned   taskset -c 1 worker --threads 1 + taskset -c 0 coordinator --threads 1 --cuts auto

then the ratios of issue 19 at every concurrency >= 8: aggregate tokens/s of "2-stage shared" over
"single" (target >= 0.9) and of "2-stage pinned" over "single pinned" (target >= 1.7), and each
configuration's interference ratio (target <= 2).

Per run (C clients, each streaming one /v1/completions request at once: a --prompt-len token-id
prompt, temperature 0, ignore_eos, so each generates exactly --tokens tokens):
  tok/s      all generated tokens / wall time (first request sent to the last [DONE])
  TTFT       request sent -> its first streamed token, p50 and p99 over the C requests
  gap        inter-token gaps: every token is timestamped when the chunk carrying it arrives; the
             gaps between consecutive tokens of one request (its first token excluded), pooled over
             all requests of the run, p50 and p99 (a chunk of k tokens gives k-1 zero gaps)
  busy sN    stage N's compute time during the run / wall time: the delta of
             pp_stage_compute_seconds_total{stage="N"} between /metrics scraped before and after
  micro-batches  pp_micro_batches at the run's end, and how often --micro-batches 0 switched during it

Interference (--long-prompt N): C streams (--interfere-clients, default 8) decode with max_tokens up
to the context (ignore_eos), so they are still decoding when the window closes; once every stream has
its first tokens and at least --baseline-seconds of steady decode, one more request with an N-token
prompt (other ids than the streams') is sent with max_tokens 1. "without" = the streams' gaps lying
wholly between the steady start and the long prompt's send; "with" = the gaps that overlap the long
prompt's prefill (its send to its first token). Printed: both p50/p99, p99 with / p99 without (the
interference ratio), and the long prompt's TTFT. Then the streams are cancelled (disconnected). The
server needs --parallel >= C + 1, else the long prompt waits in the queue (a warning says so).

Percentiles are nearest-rank: the p-th percentile of n sorted values is the ceil(p/100 * n)-th
smallest (so p99 of fewer than 100 values is the maximum).
"""
import argparse
import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

HTTP_TIMEOUT = 10.0     # /metrics, /health, /v1/models, probes
STREAM_TIMEOUT = 120.0  # longest silence on a stream socket (the server sends a keep-alive every 2 s)


class ServerError(RuntimeError):
    pass


def pct(values, p):
    """Nearest-rank percentile: the ceil(p/100 * n)-th smallest value; None when empty."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s), math.ceil(p / 100.0 * len(s))) - 1)]


def ms(x, width=8):
    return f"{'-':>{width}}" if x is None else f"{x * 1e3:>{width}.1f}"


# ---------------------------------------------------------------------------------------------- server

class Server:
    """An HTTP endpoint, and the processes behind it when this script started them (checked for life)."""

    def __init__(self, url, procs=()):
        u = urllib.parse.urlparse(url if "://" in url else "http://" + url)
        if u.scheme != "http" or not u.hostname:
            raise SystemExit(f"serve_bench: --url must be http://HOST:PORT, not {url!r}")
        self.url = url
        self.host, self.port = u.hostname, u.port or 80
        self.procs = list(procs)  # Child objects
        self.vocab = None
        self.ctx = None

    def check_alive(self):
        for c in self.procs:
            c.check()

    def request(self, method, path, body=None, timeout=HTTP_TIMEOUT):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, r.read()
        except (OSError, http.client.HTTPException) as e:
            self.check_alive()
            raise ServerError(f"{method} {self.url}{path}: {e!r}") from None
        finally:
            conn.close()

    def metrics(self):
        """{name: {frozenset(labels.items()): value}} from GET /metrics."""
        status, body = self.request("GET", "/metrics")
        if status != 200:
            raise ServerError(f"GET /metrics: HTTP {status}")
        out = {}
        for line in body.decode("utf-8", "replace").splitlines():
            m = re.match(r'([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)', line)
            if not m or line.startswith("#"):
                continue
            labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            try:
                out.setdefault(m.group(1), {})[labels] = float(m.group(3))
            except ValueError:
                pass
        return out

    def probe(self):
        """The vocabulary size (from the 400 an out-of-range id gets) and the context (/v1/models)."""
        status, body = self.request("GET", "/v1/models")
        if status != 200:
            raise ServerError(f"GET /v1/models: HTTP {status}: {body[:300]!r}")
        self.ctx = int(json.loads(body)["data"][0].get("context_length") or 2048)
        status, body = self.request("POST", "/v1/completions",
                                    json.dumps({"prompt": [2 ** 30], "max_tokens": 1}).encode())
        m = re.search(rb"vocabulary \[0, (\d+)\)", body)
        self.vocab = int(m.group(1)) if m else 128256
        if not m:
            print(f"serve_bench: could not read the vocabulary size (HTTP {status}: {body[:200]!r}); "
                  f"assuming {self.vocab}", file=sys.stderr)


def stage_compute(metrics):
    """{stage index: (compute seconds, 'layers instance')}."""
    out = {}
    for labels, v in metrics.get("pp_stage_compute_seconds_total", {}).items():
        d = dict(labels)
        out[int(d.get("stage", "0"))] = (v, f"[{d.get('layers', '?')}) {d.get('instance', '?')}")
    return out


def metric(metrics, name):
    vals = metrics.get(name, {})
    return sum(vals.values()) if vals else None


def prompt_ids(vocab, salt, i, length):
    """Token ids in the ordinary part of the vocabulary, different for every (salt, i)."""
    lo = 1000 if vocab > 20000 else 1
    span = max(16, min(100000, int(vocab * 0.75) - lo))
    return [lo + (salt * 131 + i * 7919 + j * 104729) % span for j in range(length)]


# ---------------------------------------------------------------------------------------------- streams

class Stream(threading.Thread):
    """One streamed /v1/completions request; times[k] = arrival of generated token k (monotonic)."""

    def __init__(self, srv, prompt, max_tokens):
        super().__init__(daemon=True)
        self.srv, self.prompt, self.max_tokens = srv, prompt, max_tokens
        self.times = []
        self.t_send = None
        self.t_end = None
        self.error = None
        self.finished = False   # [DONE] seen
        self.stopping = False
        self.conn = None

    def run(self):
        body = json.dumps({"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True, "return_tokens": True}).encode()
        self.conn = http.client.HTTPConnection(self.srv.host, self.srv.port, timeout=STREAM_TIMEOUT)
        try:
            self.t_send = time.monotonic()
            self.conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            r = self.conn.getresponse()
            if r.status != 200:
                self.error = f"HTTP {r.status}: {r.read(400)!r}"
                return
            event = None
            while not self.stopping:
                line = r.readline()
                now = time.monotonic()
                if not line:
                    if not self.finished and not self.stopping:
                        self.error = "the stream ended without [DONE]"
                    break
                line = line.strip()
                if line.startswith(b"event:"):
                    event = line[6:].strip()
                    continue
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    self.finished = True
                    break
                chunk = json.loads(data)
                if event == b"error" or "error" in chunk:
                    self.error = f"error event: {data[:300]!r}"
                    break
                choices = chunk.get("choices") or []
                got = len(choices[0].get("tokens") or []) if choices else 0
                self.times.extend([now] * got)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            if not self.stopping:
                self.error = repr(e)
        finally:
            self.t_end = time.monotonic()
            self.conn.close()

    def cancel(self):
        self.stopping = True
        try:
            if self.conn is not None and self.conn.sock is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def gaps(self):
        return [b - a for a, b in zip(self.times, self.times[1:])]


def wait_streams(srv, streams, deadline, what):
    for s in streams:
        while s.is_alive():
            s.join(0.25)
            srv.check_alive()
            if time.monotonic() > deadline:
                for t in streams:
                    t.cancel()
                raise ServerError(f"{what}: not done within the time limit")
    errors = [s.error for s in streams if s.error]
    if errors:
        srv.check_alive()
        raise ServerError(f"{what}: {len(errors)} request(s) failed, first: {errors[0]}")


def wait_idle(srv, timeout=60.0):
    """Until no session is active (cancelled streams close their sessions as their rows come back)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not metric(srv.metrics(), "pp_sessions_active"):
            return
        time.sleep(0.2)
    print("serve_bench: warning: sessions still active after 60 s", file=sys.stderr)


def run_load(srv, n, tokens, prompt_len, salt, limit):
    """C = n clients at once; returns the run's measurements."""
    m0 = srv.metrics()
    streams = [Stream(srv, prompt_ids(srv.vocab, salt, i, prompt_len), tokens) for i in range(n)]
    t0 = time.monotonic()
    for s in streams:
        s.start()
    wait_streams(srv, streams, t0 + limit, f"{n} clients")
    wall = time.monotonic() - t0
    m1 = srv.metrics()
    total = sum(len(s.times) for s in streams)
    short = [len(s.times) for s in streams if len(s.times) != tokens]
    if short:
        print(f"serve_bench: warning: {len(short)} request(s) got {short[:4]} tokens, not {tokens}", file=sys.stderr)
    ttft = [s.times[0] - s.t_send for s in streams if s.times]
    gaps = [g for s in streams for g in s.gaps()]
    c0, c1 = stage_compute(m0), stage_compute(m1)
    busy = {k: (c1[k][0] - c0.get(k, (0.0, ""))[0]) / wall for k in sorted(c1)}
    switches = (metric(m1, "pp_micro_batch_switches_total") or 0) - (metric(m0, "pp_micro_batch_switches_total") or 0)
    return {"mb": metric(m1, "pp_micro_batches"), "switches": switches, "clients": n, "tps": total / wall, "ttft50": pct(ttft, 50), "ttft99": pct(ttft, 99),
            "gap50": pct(gaps, 50), "gap99": pct(gaps, 99), "ngaps": len(gaps), "busy": busy,
            "stages": {k: c1[k][1] for k in c1}, "tokens": total, "wall": wall}


def interference(srv, clients, long_len, prompt_len, baseline_s, limit):
    if long_len + 1 > srv.ctx:
        raise ServerError(f"--long-prompt {long_len} does not fit the context ({srv.ctx})")
    max_tokens = srv.ctx - prompt_len - 1
    streams = [Stream(srv, prompt_ids(srv.vocab, 7777, i, prompt_len), max_tokens) for i in range(clients)]
    long = Stream(srv, prompt_ids(srv.vocab, 999983, 0, long_len), 1)
    t0 = time.monotonic()
    deadline = t0 + limit
    try:
        for s in streams:
            s.start()

        def tick(what):
            time.sleep(0.02)
            srv.check_alive()
            bad = [s.error for s in streams + [long] if s.error]
            if bad:
                raise ServerError(f"interference: a request failed: {bad[0]}")
            if any(s.finished for s in streams):
                raise ServerError("interference: a stream finished before the window ended "
                                  f"(max_tokens {max_tokens}): the server is too fast for the context; lower --baseline-seconds")
            if time.monotonic() > deadline:
                raise ServerError(f"interference: timed out {what}")

        while any(len(s.times) < 2 for s in streams):  # every stream past its prompt
            tick("waiting for every stream's first tokens")
        steady = time.monotonic()
        # A baseline of at least baseline_s and 8 gaps per stream that lie wholly after `steady`.
        while (time.monotonic() - steady < baseline_s
               or any(sum(1 for t in s.times if t >= steady) < 9 for s in streams)):
            tick("collecting the baseline")
        long.start()
        while long.t_send is None:
            tick("sending the long prompt")
        a = long.t_send
        time.sleep(0.2)
        queued = metric(srv.metrics(), "pp_queue_depth")
        while not long.times and long.is_alive():
            tick("waiting for the long prompt's first token")
        if not long.times:
            raise ServerError(f"interference: the long prompt got no token: {long.error}")
        b = long.times[0]
        # Every stream's gap that was open at b has closed: one token after b on every stream.
        while any(not s.times or s.times[-1] <= b for s in streams):
            tick("waiting for a token after the long prompt's first")
    finally:
        for s in streams + [long]:
            s.cancel()
        for s in streams + [long]:
            s.join(5)
    base, during = [], []
    for s in streams:
        for t_prev, t_cur in zip(s.times, s.times[1:]):
            if t_prev >= steady and t_cur <= a:
                base.append(t_cur - t_prev)
            if t_prev < b and t_cur > a:
                during.append(t_cur - t_prev)
    wait_idle(srv)
    r = {"clients": clients, "long": long_len, "ttft": b - a, "queued": queued,
         "base_s": a - steady, "base_n": len(base), "base50": pct(base, 50), "base99": pct(base, 99),
         "with_s": b - a, "with_n": len(during), "with50": pct(during, 50), "with99": pct(during, 99)}
    r["ratio"] = r["with99"] / r["base99"] if r["base99"] and r["with99"] is not None else None
    return r


# ---------------------------------------------------------------------------------------------- printing

def table(rows, markdown):
    nst = max((len(r["busy"]) for r in rows), default=1)
    heads = ["clients", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "gap p50 ms", "gap p99 ms"] + \
            [f"busy s{k}" for k in range(nst)] + ["micro-batches", "tokens", "wall s"]
    lines = []
    for r in rows:
        cells = [str(r["clients"]), f"{r['tps']:.2f}", ms(r["ttft50"], 0).strip(), ms(r["ttft99"], 0).strip(),
                 ms(r["gap50"], 0).strip(), ms(r["gap99"], 0).strip()]
        cells += [f"{r['busy'][k]:.2f}" if k in r["busy"] else "-" for k in range(nst)]
        mb = "-" if r["mb"] is None else f"{r['mb']:.0f}" + (f" ({r['switches']:.0f} sw)" if r["switches"] else "")
        cells += [mb, str(r["tokens"]), f"{r['wall']:.2f}"]
        lines.append(cells)
    if markdown:
        out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        out += ["| " + " | ".join(c) + " |" for c in lines]
    else:
        w = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(heads)]
        out = [" ".join(h.rjust(w[i]) for i, h in enumerate(heads))]
        out += [" ".join(c[i].rjust(w[i]) for i in range(len(heads))) for c in lines]
    return "\n".join(out)


def interference_text(r):
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
    s = (f"interference: {r['clients']} streams, one {r['long']}-token prompt sent after "
         f"{r['base_s']:.1f} s of steady decode\n"
         f"  without: {r['base_n']:>4} gaps over {r['base_s']:6.2f} s   p50 {ms(r['base50'], 0).strip()} ms  "
         f"p99 {ms(r['base99'], 0).strip()} ms\n"
         f"  with:    {r['with_n']:>4} gaps over {r['with_s']:6.2f} s   p50 {ms(r['with50'], 0).strip()} ms  "
         f"p99 {ms(r['with99'], 0).strip()} ms   (the long prompt's send to its first token)\n"
         f"  p99 with / without = {ratio} (target <= 2); long prompt TTFT {r['ttft']:.2f} s")
    if r["queued"]:
        s += (f"\n  WARNING: {r['queued']:.0f} request(s) were queued after the long prompt was sent: "
              f"--parallel < {r['clients'] + 1}, so its TTFT includes waiting for a free slot")
    return s


def measure(srv, a, title):
    """Warm-up, the concurrency sweep and the interference scenario on one server; prints as it goes."""
    srv.probe()
    print(f"\n== {title}: {srv.url}  (vocabulary {srv.vocab}, context {srv.ctx})", flush=True)
    run_load(srv, 1, 4, 8, 0, a.run_timeout)  # warm-up
    rows = []
    for rep in range(a.repeat):
        for n in a.concurrency:
            r = run_load(srv, n, a.tokens, a.prompt_len, rep * 10 + n, a.run_timeout)
            rows.append(r)
            print(f"  {n:>3} clients: {r['tps']:7.2f} tok/s  TTFT p50 {ms(r['ttft50'], 0).strip()} ms  "
                  f"gap p99 {ms(r['gap99'], 0).strip()} ms  busy "
                  + " ".join(f"s{k} {v:.2f}" for k, v in r["busy"].items()), flush=True)
    if rows:
        stages = rows[-1]["stages"]
        print("stages: " + "; ".join(f"s{k} {stages[k]}" for k in sorted(stages)))
        print(table(rows, False), flush=True)
    inter = None
    if a.long_prompt:
        inter = interference(srv, a.interfere_clients, a.long_prompt, a.prompt_len, a.baseline_seconds,
                             a.run_timeout)
        print(interference_text(inter), flush=True)
    return rows, inter


# ---------------------------------------------------------------------------------------------- suite

class Child:
    """A pp_node process with stdout and stderr in temp files."""

    def __init__(self, name, cmd, tmpdir):
        self.name, self.cmd = name, cmd
        self.out_path = os.path.join(tmpdir, re.sub(r"\W+", "_", name) + ".out")
        self.err_path = os.path.join(tmpdir, re.sub(r"\W+", "_", name) + ".err")
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err)

    def text(self, which="out"):
        with open(self.out_path if which == "out" else self.err_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def tail(self, n=25):
        lines = (self.text("out") + self.text("err")).replace("\r", "\n").splitlines()
        return "\n".join("    | " + ln for ln in lines[-n:])

    def check(self):
        rc = self.proc.poll()
        if rc is not None:
            raise ServerError(f"{self.name} exited with status {rc}: {' '.join(self.cmd)}\n"
                              f"  its output (last lines):\n{self.tail()}")

    def wait_for(self, pattern, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text("out") + self.text("err"))
            if m:
                return m
            self.check()
            time.sleep(0.1)
        raise ServerError(f"{self.name}: no {pattern!r} within {timeout:.0f} s\n  its output:\n{self.tail()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                print(f"serve_bench: {self.name} ignored SIGTERM for 20 s; killing it", file=sys.stderr)
                self.proc.kill()
                self.proc.wait(10)


CONFIGS = ["single", "2-stage shared", "single pinned", "2-stage pinned"]


def config_key(name):
    return re.sub(r"[-_ ]", "", name.lower())


def start_config(name, a, tmpdir, children):
    """Starts configuration `name`; returns its Server (its Child objects appended to `children`)."""
    pp, model, par = a.pp_node, a.model, str(a.parallel)
    pinned = name.endswith("pinned")
    threads = ["--threads", "1"] if pinned else (["--threads", str(a.threads_shared)] if a.threads_shared else [])
    ctx = ["--ctx", str(a.ctx)] if a.ctx else []
    serve = ["--model", model, "--serve", "--http-port", "0", "--parallel", par, "--log-level", "warn"] + ctx + threads
    procs = []
    if name.startswith("2-stage"):
        wcmd = (["taskset", "-c", "1"] if pinned else []) + [
            pp, "--worker", "--model", model, "--port", "0", "--host", "127.0.0.1",
            "--max-sessions", str(max(16, a.parallel + 1))] + threads
        w = Child(f"{name} worker", wcmd, tmpdir)
        children.append(w)
        procs.append(w)
        port = w.wait_for(r"listening on [\d.]+:(\d+)", a.start_timeout).group(1)
        ccmd = (["taskset", "-c", "0"] if pinned else []) + [
            pp, "--coordinator", f"127.0.0.1:{port}", "--cuts", "auto"] + serve + (
            ["--micro-batches", str(a.micro_batches_shared if not pinned else a.micro_batches_pinned)])
    else:
        ccmd = (["taskset", "-c", "0"] if pinned else []) + [pp] + serve
    c = Child(f"{name} server", ccmd, tmpdir)
    children.append(c)
    procs.append(c)
    url = c.wait_for(r"serving '.*' on (http://[\d.]+:\d+)", a.start_timeout).group(1)
    srv = Server(url, procs)
    deadline = time.monotonic() + a.start_timeout
    while True:
        try:
            status, body = srv.request("GET", "/health", timeout=2)
            if status == 200:
                break
        except ServerError:
            srv.check_alive()
        if time.monotonic() > deadline:
            raise ServerError(f"{name}: /health not 200 within {a.start_timeout:.0f} s\n{c.tail()}")
        time.sleep(0.2)
    for p in procs:
        print(f"$ {' '.join(p.cmd)}")
    for ln in c.text("out").replace("\r", "\n").splitlines():
        if re.match(r"\s*(stage \d|--cuts|pipeline:)", ln):
            print("  " + ln.strip())
    return srv


def host_info(pp_node):
    model = "?"
    try:
        for ln in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if ln.startswith("Model name:"):
                model = ln.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    version = "?"
    if pp_node:
        try:
            version = subprocess.run([pp_node, "--version"], capture_output=True, text=True,
                                     timeout=30).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    return model, version


def load_avg():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def ratio_lines(results, concurrency):
    """Issue 19's ratios at every concurrency >= 8 (aggregate tokens/s, first repeat)."""
    def tps(cfg, n):
        rows = results.get(cfg, ([], None))[0]
        vals = [r["tps"] for r in rows if r["clients"] == n]
        return sum(vals) / len(vals) if vals else None

    out = []
    for n in [c for c in dict.fromkeys(concurrency) if c >= 8]:
        for num, den, target in (("2-stage shared", "single", ">= 0.9"), ("2-stage pinned", "single pinned", ">= 1.7")):
            x, y = tps(num, n), tps(den, n)
            if x is not None and y:
                ok = (x / y >= 0.9) if target == ">= 0.9" else (x / y >= 1.7)
                out.append(f"  {n:>3} clients  {num} / {den} = {x:.2f} / {y:.2f} = {x / y:.2f}  "
                           f"(target {target}: {'met' if ok else 'NOT met'})")
    for cfg in CONFIGS:
        inter = results.get(cfg, ([], None))[1]
        if inter and inter["ratio"] is not None:
            out.append(f"  interference {cfg}: p99 with / without = {inter['with99'] * 1e3:.1f} / "
                       f"{inter['base99'] * 1e3:.1f} ms = {inter['ratio']:.2f}  "
                       f"(target <= 2: {'met' if inter['ratio'] <= 2 else 'NOT met'}); long prompt TTFT "
                       f"{inter['ttft']:.2f} s")
    return out


def summary_table(results, concurrency, markdown):
    cfgs = [c for c in CONFIGS if c in results]
    heads = ["clients"] + [f"{c} tok/s" for c in cfgs]
    rows = []
    for n in dict.fromkeys(concurrency):
        row = [str(n)]
        for c in cfgs:
            vals = [r["tps"] for r in results[c][0] if r["clients"] == n]
            row.append(f"{sum(vals) / len(vals):.2f}" if vals else "-")
        rows.append(row)
    if markdown:
        return "\n".join(["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
                         + ["| " + " | ".join(r) + " |" for r in rows])
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    return "\n".join([" ".join(h.rjust(w[i]) for i, h in enumerate(heads))]
                     + [" ".join(r[i].rjust(w[i]) for i in range(len(heads))) for r in rows])


# ---------------------------------------------------------------------------------------------- main

def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="a running server (not with --suite)")
    ap.add_argument("--suite", action="store_true", help="start each configuration itself (needs --pp-node, --model)")
    ap.add_argument("--pp-node", help="--suite: the pp_node binary")
    ap.add_argument("--model", help="--suite: the GGUF file")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="--suite: a comma list of: single, 2-stage-shared, single-pinned, 2-stage-pinned")
    ap.add_argument("--threads-shared", type=int, default=0,
                    help="--suite: --threads of the unpinned configurations (default: pp_node's, all cores)")
    ap.add_argument("--micro-batches-shared", type=int, default=0,
                    help="--suite: the 2-stage shared coordinator's --micro-batches (default 0: measured, the faster of 1 and one per stage)")
    ap.add_argument("--micro-batches-pinned", type=int, default=0,
                    help="--suite: the 2-stage pinned coordinator's --micro-batches (default 0: measured, the faster of 1 and one per stage)")
    ap.add_argument("--ctx", type=int, default=0, help="--suite: the server's --ctx (default: pp_node's)")
    ap.add_argument("--parallel", type=int, default=16,
                    help="--suite: the server's --parallel (default 16; workers get --max-sessions max(16, P+1))")
    ap.add_argument("--start-timeout", type=float, default=300, help="--suite: seconds to load and answer /health")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt ids per request")
    ap.add_argument("--repeat", type=int, default=1, help="sweeps of --concurrency")
    ap.add_argument("--long-prompt", type=int, default=0, help="interference: the long prompt's ids (0: skip)")
    ap.add_argument("--interfere-clients", type=int, default=8, help="interference: streams decoding")
    ap.add_argument("--baseline-seconds", type=float, default=3.0,
                    help="interference: least steady decode before the long prompt (also >= 8 gaps per stream)")
    ap.add_argument("--run-timeout", type=float, default=900, help="seconds one run may take")
    ap.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")
    a = ap.parse_args()
    try:
        a.concurrency = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        ap.error("--concurrency: a comma list of integers")
    if any(n < 1 for n in a.concurrency) or a.tokens < 2 or a.prompt_len < 1 or a.interfere_clients < 1:
        ap.error("--concurrency, --interfere-clients and --prompt-len must be >= 1, --tokens >= 2")
    signal.signal(signal.SIGTERM, _sigterm)

    if not a.suite:
        print(f"serve_bench {' '.join(sys.argv[1:])}\nload average {load_avg()}, nproc {os.cpu_count()}")
        rows, inter = measure(Server(a.url), a, "server")
        if a.markdown:
            print("\n" + table(rows, True))
        print(f"load average at the end {load_avg()}")
        return 0

    if not a.pp_node or not a.model:
        ap.error("--suite needs --pp-node and --model")
    keys = {config_key(c): c for c in CONFIGS}
    try:
        configs = [keys[config_key(c)] for c in a.configs.split(",") if c.strip()]
    except KeyError as e:
        ap.error(f"--configs: unknown {e}; known: {', '.join(CONFIGS)}")
    if a.long_prompt and a.parallel < a.interfere_clients + 1:
        print(f"serve_bench: warning: --parallel {a.parallel} < --interfere-clients + 1: "
              "the long prompt will queue", file=sys.stderr)
    cpu, version = host_info(a.pp_node)
    print(f"serve_bench {' '.join(sys.argv[1:])}")
    print(f"date {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    print(f"host {cpu}, nproc {len(os.sched_getaffinity(0))}, load average at start {load_avg()}")
    print(f"{version}\nmodel {a.model}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="serve_bench.") as tmpdir:
        for name in configs:
            children = []
            try:
                print(f"\n######## {name}  (load average {load_avg()})", flush=True)
                srv = start_config(name, a, tmpdir, children)
                results[name] = measure(srv, a, name)
            except ServerError as e:
                print(f"serve_bench: {name} failed: {e}", file=sys.stderr, flush=True)
                for c in children:
                    if f"{c.name} exited" not in str(e):
                        print(f"  {c.name} output (last lines):\n{c.tail()}", file=sys.stderr)
            finally:
                for c in reversed(children):
                    c.stop()
    print(f"\n######## summary  (load average at the end {load_avg()})")
    print(summary_table(results, a.concurrency, False))
    for line in ratio_lines(results, a.concurrency):
        print(line)
    if a.markdown:
        for name in configs:
            if name in results and results[name][0]:
                print(f"\n{name}:\n\n" + table(results[name][0], True))
        print("\n" + summary_table(results, a.concurrency, True))
        inters = [(c, results[c][1]) for c in CONFIGS if c in results and results[c][1]]
        if inters:
            print("\n| configuration | streams | gap p50 / p99 without, ms | gap p99 with, ms | p99 ratio | "
                  "long prompt TTFT |\n|---|---|---|---|---|---|")
            for c, r in inters:
                ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
                print(f"| {c} | {r['clients']} | {ms(r['base50'], 0).strip()} / {ms(r['base99'], 0).strip()} | "
                      f"{ms(r['with99'], 0).strip()} | {ratio} | {r['ttft']:.2f} s ({r['long']} ids) |")
    return 0 if len(results) == len(configs) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("serve_bench: interrupted", file=sys.stderr)
        sys.exit(130)
    except ServerError as e:
        print(f"serve_bench: {e}", file=sys.stderr)
        sys.exit(1)
