"""A real Prometheus server scrapes a capacity-dropping capserve (gamma = 0.5, drop) every second; its query API
reads back the same per-layer dropped-assignment counts as the server's own /metrics, and every PromQL expression
of the Grafana dashboard (deploy/grafana/capserve.json) returns data."""

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request

from capserve_e2e import ServerTestCase, chat_request, main, metric, pb

DROPPED = "capserve_moe_dropped_assignments_total"
DEPLOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy")
# What Grafana puts for its built-in interval: at least 4 scrapes (here of 1 s) so that rate() has two samples.
RATE_INTERVAL = "10s"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusTest(ServerTestCase):
    FLAGS = ["--capacity-factor", "0.5", "--capacity-policy", "drop"]

    def setUp(self):
        self.prometheus = shutil.which("prometheus")
        if self.prometheus is None:
            self.skipTest("prometheus not found: install the Debian package 'prometheus' (deploy/install_deps.sh)")

    def start_prometheus(self):
        tmp = tempfile.mkdtemp(prefix="capserve-e2e-prometheus-")
        self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
        config = os.path.join(tmp, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                    "scrape_configs:\n  - job_name: capserve-e2e\n    static_configs:\n"
                    f"      - targets: ['127.0.0.1:{self.server.metrics_port}']\n")
        address = f"127.0.0.1:{free_port()}"
        self.api = f"http://{address}/api/v1/query?query="
        self.log = os.path.join(tmp, "prometheus.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([self.prometheus, f"--config.file={config}",
                                          f"--storage.tsdb.path={tmp}/data", f"--web.listen-address={address}"],
                                         stdout=log, stderr=subprocess.STDOUT)
        self.addCleanup(self.proc.wait, 10)
        self.addCleanup(self.proc.kill)

    def result(self, promql):
        """The samples of an instant query, or None while Prometheus is not answering yet."""
        if self.proc.poll() is not None:
            with open(self.log) as f:
                self.fail(f"prometheus exited with status {self.proc.returncode}:\n{f.read()}")
        try:
            with urllib.request.urlopen(self.api + urllib.parse.quote(promql), timeout=5) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            # 503 until its storage and rule manager are ready (seconds on a loaded machine): not an answer yet.
            if e.code == 503:
                return None
            self.fail(f"Prometheus refused {promql!r}: {e.read().decode()}")
        except OSError:
            return None
        return body["data"]["result"]

    def query(self, promql):
        """{layer: value} of an instant query, or None while Prometheus is not answering yet."""
        samples = self.result(promql)
        return None if samples is None else {s["metric"].get("layer", ""): float(s["value"][1]) for s in samples}

    def test_deployed_scrape_config_is_valid(self):
        config = os.path.join(DEPLOY, "prometheus", "prometheus.yml")
        check = subprocess.run([shutil.which("promtool") or "promtool", "check", "config", config],
                               capture_output=True, text=True)
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)

    def test_every_dashboard_expression_returns_data(self):
        with open(os.path.join(DEPLOY, "grafana", "capserve.json")) as f:
            dashboard = json.load(f)
        variables = {"model_name": self.server.model_id, "__rate_interval": RATE_INTERVAL}
        self.assertEqual({v["name"] for v in dashboard["templating"]["list"]} - {"datasource"}, {"model_name"})
        exprs = []
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], target["expr"])
                exprs.append((panel["title"], expr))
        self.assertGreaterEqual(len(exprs), 20)
        self.start_prometheus()
        # Requests spread over a few scrapes, so that every rate() window holds increases.
        for i in range(3):
            self.stub.Chat(chat_request(f"Count to {i + 3}.", max_tokens=8), timeout=120)
        self.wait_for(lambda: self.result(f'capserve_build_info{{model_name="{self.server.model_id}"}}'), 60,
                      "Prometheus to scrape capserve")
        # The model variable's own query (label_values over capserve_build_info) finds the served model.
        self.assertEqual([s["metric"]["model_name"] for s in self.result("capserve_build_info")], [self.server.model_id])
        empty = []

        def all_answer():
            empty[:] = [(title, expr) for title, expr in exprs if not self.result(expr)]
            return not empty
        self.wait_for(all_answer, 60, lambda: "data for every dashboard expression; empty: " +
                      "; ".join(f"{title}: {expr}" for title, expr in empty))

    def test_prometheus_reads_the_dropped_counter(self):
        info = self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        self.assertRegex(info.capacity, r"^gamma=0.5 policy=drop ")
        self.start_prometheus()
        dropped = 0
        for i in range(4):
            reply = self.stub.Chat(chat_request(f"Describe the weather in city number {i}.", max_tokens=16),
                                   timeout=120)
            dropped += reply.moe.dropped
        self.assertGreater(dropped, 0, "gamma = 0.5 dropped nothing on these requests' behalf")

        def idle():
            m = self.server.metrics()
            return m if metric(m, "capserve_requests_running") == 0 else None
        samples = self.wait_for(idle, 60, "the server to finish the requests")
        # Bounded by default: per (layer, rank), per expert only with --metrics-per-expert (test_api.py).
        self.assertIsNone(metric(samples, "capserve_moe_expert_tokens_total"))
        self.assertGreater(metric(samples, "capserve_moe_rank_tokens_total"), 0)
        self.assertEqual(metric(samples, "capserve_kv_cache_total_blocks"), 1024)
        self.assertEqual(metric(samples, "capserve_build_info", model_name=self.server.model_id), 1)
        expected = {dict(ls)["layer"]: v for (name, ls), v in samples.items() if name == DROPPED}
        self.assertGreater(sum(expected.values()), 0)
        self.assertGreaterEqual(sum(expected.values()), dropped)
        last = None

        def read_back():
            nonlocal last
            last = self.query(DROPPED + '{job="capserve-e2e"}')
            return last == expected

        self.wait_for(read_back, 60, lambda: f"Prometheus to read back {DROPPED} = {expected} (last read: {last})")
        self.assertEqual(self.query('up{job="capserve-e2e"}'), {"": 1.0})


if __name__ == "__main__":
    main()
