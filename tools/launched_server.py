"""capserve started under deploy/launch.sh for a benchmark or an evaluation, and stopped by SIGTERM (graceful
drain) on leaving the `with`: the one way tools/ start a server and find its ports. Standard library only.

    with LaunchedServer(build, np=2, flags=[...], log=Path("server.log")) as server:
        server.target   # "localhost:PORT" (gRPC)
        server.metrics  # "http://localhost:PORT/metrics"
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "deploy" / "models" / "capserve-moe-tiny"
SERVING = re.compile(r"capserve: serving .* on (\S+):(\d+), metrics on port (\d+)")


class LaunchedServer:
    def __init__(self, build: Path, np: int, flags: list[str], log: Path, start_timeout_s: float = 120,
                 model: Path = DEFAULT_MODEL):
        self.log = log
        self.command = ["bash", str(ROOT / "deploy" / "launch.sh"), str(np), str(build / "server" / "capserve"),
                        "--model", str(model), "--port", "0", "--metrics-port", "0", *flags]
        self.proc = subprocess.Popen(self.command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while True:
            found = SERVING.search(log.read_text(errors="replace"))
            if found:
                self.target = f"localhost:{found.group(2)}"
                self.metrics = f"http://localhost:{found.group(3)}/metrics"
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
                raise SystemExit(f"the server did not start ({' '.join(self.command)}):\n{tail}")
            time.sleep(0.5)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()

    def __enter__(self) -> "LaunchedServer":
        return self

    def __exit__(self, *exc) -> None:
        code = self.stop()
        if code != 0 and exc[0] is None:
            raise SystemExit(f"the server exited {code} after draining; see {self.log}")
