#!/usr/bin/env python3
"""Runs a client command against a fresh CapServe with its HTTP API, then stops the server.

    tools/with_capserve.py [--build DIR] [--model DIR] [--np N] [--counts FILE] [--server-args="FLAGS"] -- COMMAND [ARGS...]

capserve starts on N ranks (deploy/launch.sh) with --http-port 0; COMMAND runs (a single argument through
bash -c, so it may use the variables) with CAPSERVE_HTTP_PORT, CAPSERVE_BASE_URL (http://127.0.0.1:PORT/v1)
and CAPSERVE_MODEL_ID set.
Before and after it, /metrics is read: --counts FILE gets the server's finished requests by finish_reason and its
refused ones (capserve_request_errors_total) that COMMAND caused, as JSON, so a benchmark client's own request
count can be checked against the server's. Exit status: COMMAND's, or 1 when the server failed.
Only Debian's python3 is needed (standard library)."""

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_LINE = re.compile(
    r"capserve: serving (\S+) on \S+:\d+, metrics on port (\d+), \d+ ranks.*HTTP API on port (\d+)")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def counters(metrics_port):
    """{finish_reason: finished requests} and {code: refused requests} from the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    finished, errors = {}, {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m or m.group(1) not in ("capserve_requests_total", "capserve_request_errors_total"):
            continue
        labels = dict(LABEL.findall(m.group(2) or ""))
        if m.group(1) == "capserve_requests_total":
            finished[labels.get("finish_reason", "")] = float(m.group(3))
        else:
            errors[labels.get("code", "")] = float(m.group(3))
    return finished, errors


def delta(after, before):
    return {k: int(v - before.get(k, 0)) for k, v in after.items() if v != before.get(k, 0)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"), help="CMake build directory")
    parser.add_argument("--model", default=os.path.join(ROOT, "deploy/models/capserve-moe-tiny"))
    parser.add_argument("--np", type=int, default=2, help="ranks")
    parser.add_argument("--threads", type=int, default=1, help="capserve --threads per rank")
    parser.add_argument("--counts", help="write the server's request counts caused by COMMAND here (JSON)")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--server-args", default="", type=shlex.split, help="more capserve flags, one string")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND after --")
    binary = os.path.join(args.build, "server/capserve")
    if not os.access(binary, os.X_OK):
        parser.error(f"{binary} is not built (cmake --build {args.build} --target capserve)")

    server = subprocess.Popen(["bash", os.path.join(ROOT, "deploy/launch.sh"), str(args.np), binary, "--model",
                               args.model, "--port", "0", "--metrics-port", "0", "--http-port", "0", "--threads",
                               str(args.threads), *args.server_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    started = threading.Event()
    found = {}
    log = []

    def pump():
        for line in server.stdout:
            log.append(line)
            m = START_LINE.search(line)
            if m and not started.is_set():
                found.update(model=m.group(1), metrics=int(m.group(2)), http=int(m.group(3)))
                started.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + args.start_timeout
    try:
        while not started.wait(0.2):
            if server.poll() is not None or time.monotonic() > deadline:
                sys.stderr.write("with_capserve: capserve did not start:\n" + "".join(log[-40:]))
                return 1
        print(f"with_capserve: {found['model']} on http://127.0.0.1:{found['http']}/v1, metrics on port "
              f"{found['metrics']}", file=sys.stderr, flush=True)
        before = counters(found["metrics"])
        env = dict(os.environ, CAPSERVE_HTTP_PORT=str(found["http"]), CAPSERVE_MODEL_ID=found["model"],
                   CAPSERVE_BASE_URL=f"http://127.0.0.1:{found['http']}/v1")
        # One argument is a shell command line (it may use the variables); more are a program and its arguments.
        argv = ["bash", "-c", command[0]] if len(command) == 1 else command
        rc = subprocess.run(argv, env=env).returncode
        after = counters(found["metrics"])
        counts = {"finished": delta(after[0], before[0]), "refused": delta(after[1], before[1])}
        counts["finished_total"] = sum(counts["finished"].values())
        print("with_capserve: server counts " + json.dumps(counts), file=sys.stderr, flush=True)
        if args.counts:
            with open(args.counts, "w") as f:
                json.dump(counts, f, indent=1)
        if server.poll() is not None:
            sys.stderr.write("with_capserve: capserve exited during the run:\n" + "".join(log[-40:]))
            return 1
        return rc
    finally:
        if server.poll() is None:
            # SIGTERM to the launcher reaches rank 0, which drains and stops every rank (deploy/launch.sh).
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


if __name__ == "__main__":
    sys.exit(main())
