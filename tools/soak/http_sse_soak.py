#!/usr/bin/env python3
"""SSE soak of the OpenAI HTTP API: N concurrent streamed chat completions (closed loop) for a while against a
server on 2 ranks, with the resident memory and thread count of rank 0 sampled over time.

    tools/soak/http_sse_soak.py --build-dir build            # 200 streams, 120 s, report in tools/results/

It starts `deploy/launch.sh RANKS <build>/server/capserve --model deploy/models/capserve-moe-tiny --port 0
--metrics-port 0 --http-port 0 --threads 1 [--server-arg ...]`, keeps --streams raw-socket SSE requests open
(each a new connection, max_tokens drawn from 8..--max-tokens, its own prompt), samples VmRSS and Threads of both
ranks every --interval-s, then stops sending, waits for the streams in flight, SIGTERMs the server and requires
exit 0. Every request must end in exactly one terminal outcome: `ok` (a finish_reason, then [DONE]) or `error`
(an OpenAI error object: an HTTP error status or an error event before [DONE]). A stream that ends without
either, a broken connection or a client timeout counts as `lost`. The run fails (exit 1) when any request was
lost or not ok, rank 0's RSS after warm-up grew past --rss-tolerance-pct, or the drain did not exit 0. Writes
<out-dir>/<name>.json (figures and samples) and <out-dir>/<name>.md (the report, with the command).
With --tls the server runs with --tls-cert/--tls-key/--api-key-file (a CA and certificate made by the openssl
CLI in a temporary directory) and every stream is HTTPS with `Authorization: Bearer KEY`.
Debian's python3 only (asyncio, no extra packages)."""

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_LINE = re.compile(r"capserve: serving \S+ on \S+:\d+, metrics on port \d+, \d+ ranks.*HTTP API on port (\d+)")
WORDS = ("expert router token batch rank memory stream latency cache prompt model layer gate softmax kernel "
         "matrix vector queue server client request answer number story river mountain city music").split()


def descendants(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for c in out for d in (int(c), *descendants(int(c)))]


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() != "capserve":
                return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                    return int(kv.split(b"=")[1])
    except OSError:
        pass
    return None


def proc_status(pid):
    """(VmRSS in KiB, Threads) of a live process, else None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]), int(fields["Threads"])
    except (OSError, KeyError, ValueError):
        return None


def make_tls(directory):
    """(server flags, client SSLContext, API key): a CA, a server certificate for localhost, a key file."""
    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    def path(name):
        return os.path.join(directory, name)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", path("ca.key"), "-out", path("ca.pem"), "-days", "2", "-subj", "/CN=soak")
    openssl("req", *ec, "-keyout", path("server.key"), "-out", path("server.csr"), "-subj", "/CN=localhost")
    with open(path("server.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", path("server.csr"), "-CA", path("ca.pem"), "-CAkey", path("ca.key"),
            "-CAcreateserial", "-days", "2", "-out", path("server.pem"), "-extfile", path("server.ext"))
    key = "sk-soak-" + os.urandom(12).hex()
    with open(path("api.key"), "w") as f:
        f.write(key + "\n")
    flags = ["--tls-cert", path("server.pem"), "--tls-key", path("server.key"), "--api-key-file", path("api.key")]
    return flags, ssl.create_default_context(cafile=path("ca.pem")), key


async def one_stream(port, max_tokens, rng, timeout_s, tls=None, key=None):
    """The terminal outcome of one streamed chat completion: "ok", "error" or "lost"."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
    body = json.dumps({"model": "capserve-moe-tiny", "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls,
                                                           server_hostname="localhost" if tls else None)
            auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n" +
                         auth + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            rest = await reader.read()  # the server closes after the response
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError,
            ssl.SSLError):
        return "lost"
    finally:
        if writer is not None:
            writer.close()
    if status != 200:
        return "error" if b'"error"' in rest else "lost"
    # De-chunk, then read the events.
    text = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        try:
            size = int(size_line, 16)
        except ValueError:
            return "lost"
        if size == 0:
            break
        text += rest[:size]
        rest = rest[size + 2:]
    else:
        return "lost"  # no last chunk: the stream was cut
    payloads = [line[6:] for line in text.split(b"\n") if line.startswith(b"data: ")]
    if not payloads or payloads[-1] != b"[DONE]":
        return "lost"
    events = [json.loads(p) for p in payloads[:-1]]
    if any("error" in e for e in events):
        return "error"
    finished = [c.get("finish_reason") for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    return "ok" if len(finished) == 1 else "lost"


async def drive(args, port, tls, key):
    rng = random.Random(args.seed)
    outcomes = {"ok": 0, "error": 0, "lost": 0}
    stop_at = time.monotonic() + args.duration_s

    async def worker(i):
        local = random.Random(rng.random() + i)
        while time.monotonic() < stop_at:
            outcome = await one_stream(port, local.randint(8, args.max_tokens), local, args.request_timeout_s, tls,
                                       key)
            outcomes[outcome] += 1

    await asyncio.gather(*(worker(i) for i in range(args.streams)))
    return outcomes


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", default="build")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--duration-s", type=float, default=120)
    p.add_argument("--warmup-s", type=float, default=30, help="RSS growth is judged from this second on")
    p.add_argument("--interval-s", type=float, default=5)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--request-timeout-s", type=float, default=300)
    p.add_argument("--rss-tolerance-pct", type=float, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--server-arg", action="append", default=[], help="extra capserve flag (repeatable)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "tools", "results"))
    p.add_argument("--name", help="report file name (default: soak_http_sse, soak_http_sse_tls with --tls)")
    p.add_argument("--tls", action="store_true", help="HTTPS with an API key (certificates made here)")
    args = p.parse_args()
    build = args.build_dir if os.path.isabs(args.build_dir) else os.path.join(ROOT, args.build_dir)
    capserve = os.path.join(build, "server", "capserve")
    if not os.access(capserve, os.X_OK):
        sys.exit(f"http_sse_soak: no {capserve}: build it first")
    args.name = args.name or ("soak_http_sse_tls" if args.tls else "soak_http_sse")
    certs = tempfile.mkdtemp(prefix="capserve-soak-tls-")
    tls_flags, tls, key = make_tls(certs) if args.tls else ([], None, None)
    cmd = ["bash", os.path.join(ROOT, "deploy", "launch.sh"), str(args.ranks), capserve, "--model",
           os.path.join(ROOT, "deploy", "models", "capserve-moe-tiny"), "--port", "0", "--metrics-port", "0",
           "--http-port", "0", "--threads", "1", "--max-queue", str(max(512, 2 * args.streams)), *tls_flags,
           *args.server_arg]
    print("http_sse_soak: starting", " ".join(cmd), file=sys.stderr, flush=True)
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    log, started = [], threading.Event()
    found = {}

    def pump():
        for line in server.stdout:
            log.append(line)
            m = START_LINE.search(line)
            if m and not started.is_set():
                found["http_port"] = int(m.group(1))
                started.set()

    threading.Thread(target=pump, daemon=True).start()
    samples, ranks, exit_code, outcomes = [], {}, None, None
    try:
        deadline = time.monotonic() + 180
        while not started.wait(0.2):
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit("http_sse_soak: capserve did not start:\n" + "".join(log[-30:]))
        ranks = {rank_of(d): d for d in descendants(server.pid) if rank_of(d) is not None}
        if sorted(ranks) != list(range(args.ranks)):
            sys.exit(f"http_sse_soak: expected {args.ranks} ranks, found {ranks}")
        t0 = time.monotonic()
        sampling = threading.Event()

        def sample():
            while not sampling.wait(args.interval_s if samples else 0):
                row = {"t_s": round(time.monotonic() - t0, 1)}
                for r, pid in ranks.items():
                    st = proc_status(pid)
                    row[f"rank{r}_rss_kib"], row[f"rank{r}_threads"] = st if st else (None, None)
                samples.append(row)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        outcomes = asyncio.run(drive(args, found["http_port"], tls, key))
        elapsed = time.monotonic() - t0
        sampling.set()
        sampler.join()
        server.send_signal(signal.SIGTERM)  # rank 0 drains, then every rank stops
        try:
            exit_code = server.wait(60)
        except subprocess.TimeoutExpired:
            exit_code = None
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        shutil.rmtree(certs, ignore_errors=True)

    after = [s for s in samples if s["t_s"] >= args.warmup_s and s["rank0_rss_kib"]]
    rss = [s["rank0_rss_kib"] for s in after]
    threads = [s["rank0_threads"] for s in samples if s["rank0_threads"]]
    growth_pct = 100.0 * (rss[-1] - rss[0]) / rss[0] if len(rss) >= 2 else None
    total = sum(outcomes.values())
    checks = {
        "every request ok (none lost, none refused)": outcomes["lost"] == 0 and outcomes["error"] == 0,
        f"rank 0 RSS after {args.warmup_s:g} s within {args.rss_tolerance_pct:g}%":
            growth_pct is not None and growth_pct <= args.rss_tolerance_pct,
        "drain exit 0": exit_code == 0,
    }
    figures = {
        "command": " ".join(sys.argv),
        "server_command": " ".join(cmd[1:]).replace(ROOT + "/", "").replace(certs, "$TMP"), "streams": args.streams,
        "duration_s": round(elapsed, 1), "requests": total, "outcomes": outcomes,
        "requests_per_s": round(total / elapsed, 1),
        "rank0_rss_mib_after_warmup": {"first": round(rss[0] / 1024, 1), "last": round(rss[-1] / 1024, 1),
                                       "max": round(max(rss) / 1024, 1)} if rss else None,
        "rank0_rss_growth_pct": None if growth_pct is None else round(growth_pct, 2),
        "rank0_threads": {"min": min(threads), "max": max(threads)} if threads else None,
        "drain_exit_code": exit_code, "checks": checks, "samples": samples,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, args.name + ".json"), "w") as f:
        json.dump(figures, f, indent=1)
    lines = [f"# HTTP SSE soak: {args.streams} concurrent streams for {args.duration_s:g} s on {args.ranks} ranks"
             + (" (HTTPS, API key)" if args.tls else ""),
             "", "```sh", figures["command"], "```", "",
             f"Server: `{figures['server_command']}`", "",
             f"- requests: {total} ({figures['requests_per_s']}/s); outcomes: {outcomes}",
             f"- rank 0 RSS after {args.warmup_s:g} s warm-up (MiB): {figures['rank0_rss_mib_after_warmup']}, "
             f"growth {figures['rank0_rss_growth_pct']}%",
             f"- rank 0 threads over the run: {figures['rank0_threads']}",
             f"- drain after SIGTERM: exit {exit_code}", "", "| check | result |", "| --- | --- |",
             *[f"| {name} | {'pass' if ok else 'FAIL'} |" for name, ok in checks.items()], "",
             "| t (s) | " + " | ".join(f"rank {r} RSS (MiB) | rank {r} threads" for r in sorted(ranks)) + " |",
             "| --- |" + " --- | --- |" * len(ranks)]
    for s in samples:
        cells = [f"{(s[f'rank{r}_rss_kib'] or 0) / 1024:.1f} | {s[f'rank{r}_threads']}" for r in sorted(ranks)]
        lines.append(f"| {s['t_s']} | " + " | ".join(cells) + " |")
    with open(os.path.join(args.out_dir, args.name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:12]))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
