"""Serves one model with capserve on one rank, once per device given, sends the same greedy chats over HTTP to
each, and compares the tokens (the GPU runner's served-chat step; tools/gpu/README.md). Where two devices' greedy
tokens part, the first device's log-probabilities say whether that was a near-tie: with bf16 weights the GPU's
GEMMs round activations to bf16 and the CPU does not, so two tokens whose log-probabilities differ by less than
--tie-nats may swap, and the texts after them are not comparable. Writes every answer and verdict to --json; exit
0 when every server answered every chat and every pair is equal or parts only at a near-tie, 1 otherwise.

    python3 tools/gpu/chat_check.py --capserve BIN --model DIR --devices cuda,cpu --json OUT.json
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

PROMPTS = [
    "Tell me about the mixture of experts.",
    "Write a short story about a lighthouse keeper.",
    "What is the capital of France, and why?",
    "List three uses of a graphics processor.",
]


class Server:
    """capserve on one rank (an Open MPI singleton) with the HTTP API on a free port."""

    def __init__(self, binary, model, device, extra, log_path, ld_path):
        cmd = [binary, "--model", model, "--device", device, "--port", "0", "--metrics-port", "0",
               "--http-port", "0", "--threads", str(min(8, os.cpu_count() or 1))] + extra
        self.log = open(log_path, "w")
        env = dict(os.environ)
        if ld_path is not None:
            env["LD_LIBRARY_PATH"] = ld_path
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.port, self.start_line = None, None
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            m = re.search(r"capserve: serving .* on (\S+), .*HTTP API on port (\d+)", line)
            if m:
                self.start_line, self.port = line.strip(), int(m.group(2))
                self.ready.set()
        self.ready.set()  # the process ended: wait_ready sees no port

    def wait_ready(self, timeout):
        self.ready.wait(timeout)
        return self.port is not None

    def chat(self, prompt, max_tokens, timeout):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
                "logprobs": True, "top_logprobs": 2}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as e:
            return {"error": f"HTTP {e.code}: {e.read()[:300]!r}"}
        except OSError as e:
            return {"error": f"{type(e).__name__}: {e}"}
        choice = answer["choices"][0]
        tokens = [{"token": c["token"], "logprob": c["logprob"],
                   "top": {t["token"]: t["logprob"] for t in c.get("top_logprobs", [])}}
                  for c in (choice.get("logprobs") or {}).get("content") or []]
        return {"text": choice["message"]["content"], "tokens": tokens, "usage": answer.get("usage"),
                "seconds": time.monotonic() - t0}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def compare(a, b, tie_nats):
    """a's and b's greedy tokens: equal, parted at a near-tie of a's log-probabilities, or different."""
    if "tokens" not in a or "tokens" not in b:
        return {"verdict": "no answer"}
    ta, tb = a["tokens"], b["tokens"]
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x["token"] == y["token"]:
            continue
        # a chose x; how much less likely did a find b's token y (in a's top 2)?
        gap = x["logprob"] - x["top"][y["token"]] if y["token"] in x["top"] else float("inf")
        return {"verdict": "near-tie" if gap <= tie_nats else "different", "at": i, "gap": gap,
                "tokens": [x["token"], y["token"]]}
    return {"verdict": "equal" if len(ta) == len(tb) else "different lengths", "at": min(len(ta), len(tb))}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--capserve", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--devices", default="cuda,cpu", help="comma-separated; the first is compared to the others")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--start-timeout", type=float, default=120)
    ap.add_argument("--chat-timeout", type=float, default=120)
    ap.add_argument("--tie-nats", type=float, default=0.05,
                    help="a parting where the first device's log-probabilities of the two tokens differ by at most "
                         "this is a near-tie")
    ap.add_argument("--json", required=True)
    ap.add_argument("--log-prefix", default="server")
    ap.add_argument("--ld-library-path", help="LD_LIBRARY_PATH for capserve (the bundle's libraries)")
    ap.add_argument("extra", nargs="*", help="more capserve flags (after --)")
    args = ap.parse_args()

    result = {"model": args.model, "devices": {}, "equal": None}
    ok = True
    for device in args.devices.split(","):
        server = Server(args.capserve, args.model, device, args.extra, f"{args.log_prefix}_{device}.log",
                        args.ld_library_path)
        entry = {"answers": []}
        if server.wait_ready(args.start_timeout):
            entry["start_line"] = server.start_line
            entry["answers"] = [server.chat(p, args.max_tokens, args.chat_timeout) for p in PROMPTS]
        else:
            entry["error"] = "no start line (see the server log)"
        entry["exit"] = server.stop()
        result["devices"][device] = entry
        ok = ok and "error" not in entry and all("text" in a for a in entry["answers"])
        print(f"{device}: {entry.get('start_line', entry.get('error'))}", flush=True)
        for p, a in zip(PROMPTS, entry["answers"]):
            print(f"  {p!r} -> {a.get('text', a.get('error'))!r}", flush=True)

    devices = args.devices.split(",")
    first = devices[0]
    result["compared"] = {}
    for d in devices[1:]:
        verdicts = [compare(a, b, args.tie_nats) for a, b in
                    zip(result["devices"][first]["answers"], result["devices"][d]["answers"])]
        result["compared"][d] = verdicts
        equal = sum(v["verdict"] == "equal" for v in verdicts)
        ties = [v for v in verdicts if v["verdict"] == "near-tie"]
        bad = [v for v in verdicts if v["verdict"] not in ("equal", "near-tie")]
        summary = f"greedy texts {first} vs {d}: {equal} of {len(verdicts)} equal"
        if ties:
            summary += ", " + ", ".join(f"parted at token {v['at']} on a near-tie ({v['gap']:.3f} nats)" for v in ties)
        if bad:
            summary += ", DIFFERENT: " + ", ".join(f"{v['verdict']} at token {v.get('at')}" for v in bad)
        print(summary, flush=True)
        ok = ok and not bad
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
