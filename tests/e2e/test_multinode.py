"""capserve across hosts: two test hosts as network namespaces (tests/e2e/netns_hosts.py), ranks 0 and 1 on h0 and
rank 2 on h1, started by deploy/launch.sh --hostfile with Open MPI over TCP and a launch agent that enters the
namespaces in place of ssh.

- The start-up log names each rank's host and local rank and the transport; greedy chats equal the same job's on
  one host; SIGTERM to the launcher drains across hosts, exit 0.
- 20 ms delay and 1% loss on h1's link: the same chats, only slower (throughput printed against the clean link).
- h1's link cut, or every process of h1 killed: every in-flight request ends UNAVAILABLE and the job exits
  non-zero within the step watchdog's bound plus LIMIT_S.
Skips, saying which command failed, where this machine cannot create network namespaces (e.g. not root).
"""

import os
import subprocess
import sys
import threading
import time
import unittest

import grpc

from capserve_e2e import BIN, LAUNCH, Server, chat_request, main, metric, pb
from netns_hosts import TestHosts, Unsupported

# The test hosts share this machine's cores, which Open MPI cannot know (each hostfile line is a host of its own
# slots): without yielding, ranks spinning in a collective take whole time slices from the rank they wait for,
# and the job runs ~50x slower (launch.sh passes --oversubscribe, which implies this, on one node).
os.environ["OMPI_MCA_mpi_yield_when_idle"] = "1"

SLOTS = {"h0": 2, "h1": 1}
NP = sum(SLOTS.values())
PROMPTS = ["Tell me about the sea.", "What is a robot?", "Write a short poem about rain."]
TOKENS = 12
BOUND_S = 3
LIMIT_S = BOUND_S + 12


def chats(stub):
    """PROMPTS at once, greedy, TOKENS each: ({prompt: (text, completion tokens)}, tokens per second)."""
    out = {}

    def one(prompt):
        reply = stub.Chat(chat_request(prompt, TOKENS, ignore_eos=True), timeout=300)
        out[prompt] = (reply.text, reply.usage.completion_tokens)

    start = time.monotonic()
    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    return out, sum(n for _, n in out.values()) / elapsed


class MultiHostTest(unittest.TestCase):
    reference = None
    clean_tokens_per_s = None

    @classmethod
    def setUpClass(cls):
        try:
            TestHosts({"probe": 1}).close()
        except Unsupported as e:
            raise unittest.SkipTest(f"cannot create test hosts here: {e}")
        server = Server(np=NP)
        try:
            server.start()
            cls.reference, tokens_per_s = chats(server.stub)
            print(f"one host: {tokens_per_s:.1f} tokens/s", file=sys.stderr)
        finally:
            server.stop()

    def hosts(self, **options):
        """Test hosts removed after the test (cleanups run last first: after the server's)."""
        hosts = TestHosts(SLOTS, **options)
        self.addCleanup(hosts.close)
        return hosts

    def across(self, hosts, *flags):
        server = Server(*flags, np=NP, launch_args=hosts.launch_args(), connect_host=hosts.address("h0"))
        self.addCleanup(server.stop)
        # First of all, the processes a fault cut off: they would outlive mpirun and hold its output open.
        self.addCleanup(hosts.kill, "h1")
        return server.start()

    def test_0_bad_host_options_are_refused_naming_them(self):
        for args, why in [
            (["--transport", "rdma"], "--transport rdma: tcp, ucx or auto"),
            (["--hostfile", "/nonexistent/hosts"], "--hostfile /nonexistent/hosts: no such readable file"),
            (["--hosts"], "usage: deploy/launch.sh"),
            (["--hosts", "h0:1", "two"], "N must be a positive rank count, not 'two'"),
        ]:
            done = subprocess.run(["bash", LAUNCH, *args, BIN], capture_output=True, text=True, timeout=30)
            self.assertEqual(done.returncode, 2, args)
            self.assertIn(why, done.stderr, args)

    def test_1_chats_across_hosts_equal_one_host(self):
        hosts = self.hosts()
        server = self.across(hosts)
        log = "".join(server.log)
        h0, h1 = hosts.namespace("h0"), hosts.namespace("h1")
        self.assertIn(f"capserve: rank 0 runs on host {h0} (local rank 0 of 2)", log)
        self.assertIn(f"capserve: rank 1 runs on host {h0} (local rank 1 of 2)", log)
        self.assertIn(f"capserve: rank 2 runs on host {h1} (local rank 0 of 1)", log)
        # Open MPI turns launch.sh --iface CIDR into the interfaces on it: eth0 on every test host.
        self.assertIn("capserve: MPI transport: pml ob1, btl self,vader,tcp on eth0", log)
        out, tokens_per_s = chats(server.stub)
        self.assertEqual(out, self.reference)
        MultiHostTest.clean_tokens_per_s = tokens_per_s
        print(f"two hosts, clean link: {tokens_per_s:.1f} tokens/s", file=sys.stderr)
        # The launcher's SIGTERM reaches rank 0 on another host (SIGUSR1 through mpirun): drain, exit 0.
        server.proc.terminate()
        self.assertEqual(server.wait_exit(60), 0)

    def test_2_delay_and_loss_lose_nothing(self):
        hosts = self.hosts(impaired={"h1": (20, 1)})
        server = self.across(hosts)
        out, tokens_per_s = chats(server.stub)
        clean = MultiHostTest.clean_tokens_per_s
        print(f"20 ms delay + 1% loss on h1's link ({hosts.impairment}): {tokens_per_s:.1f} tokens/s, clean "
              f"{clean and round(clean, 1)} tokens/s", file=sys.stderr)
        self.assertEqual(out, self.reference)

    def fail_h1(self, fault, what):
        hosts = self.hosts()
        server = self.across(hosts, "--step-timeout-s", str(BOUND_S))
        calls = {
            "stream": lambda: server.stub.ChatStream(chat_request("A long story.", 800, ignore_eos=True)),
            "generate": lambda: server.stub.Generate(pb.GenerateRequest(
                input_ids=[7, 8, 9], sampling=pb.SamplingOptions(max_tokens=800, ignore_eos=True))),
            "unary chat": lambda: [server.stub.Chat(chat_request("A story.", 800, ignore_eos=True))],
        }
        ended = {}

        def run(name):
            try:
                for _ in calls[name]():
                    pass
                ended[name] = (grpc.StatusCode.OK, "", time.monotonic())
            except grpc.RpcError as e:
                ended[name] = (e.code(), e.details(), time.monotonic())

        threads = [threading.Thread(target=run, args=(name,), daemon=True) for name in calls]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while metric(server.metrics(), "capserve_requests_running") != len(calls):
            self.assertLess(time.monotonic(), deadline, "the requests never all ran")
            time.sleep(0.05)
        fault(hosts)
        at = time.monotonic()
        for t in threads:
            t.join(max(0.0, at + LIMIT_S - time.monotonic()))
        status = server.wait_exit(max(0.0, at + LIMIT_S - time.monotonic()))
        print(f"{what}: requests ended after {sorted(round(t - at, 2) for *_, t in ended.values())} s "
              f"({sorted({f'{c.name}: {d}' for c, d, _ in ended.values()})}), job exit status {status} after "
              f"{time.monotonic() - at:.2f} s", file=sys.stderr)
        self.assertEqual(sorted(ended), sorted(calls), f"requests still open {LIMIT_S} s after: {what}")
        for name, (code, details, _) in ended.items():
            self.assertEqual(code, grpc.StatusCode.UNAVAILABLE, f"{name}: {details}")
        self.assertIsNotNone(status, f"the job still runs {LIMIT_S} s after: {what}")
        self.assertNotEqual(status, 0)

    def test_3_cut_link_ends_every_request_and_the_job(self):
        self.fail_h1(lambda hosts: hosts.cut("h1"), "h1's link cut")

    def test_4_killed_host_ends_every_request_and_the_job(self):
        self.fail_h1(lambda hosts: hosts.kill("h1"), "h1's processes killed")


if __name__ == "__main__":
    main()
