"""Test hosts on one machine: network namespaces joined by a bridge, for the multi-host e2e tests.

`TestHosts({"h0": 2, "h1": 1})` creates one namespace per host (the name is also the host name its processes see,
through tests/e2e/netns_agent.sh), each with an `eth0` on a /24 subnet of its own choosing and a link to a bridge
in this (the root) namespace, which holds the subnet's .1 and so reaches every host. It writes an Open MPI hostfile
(`hostfile`, with each host's slots) and knows the launch agent (`agent`). Every name carries this process's pid, so
tests running at once never meet, and hosts left behind by a test that was killed are removed by the next one.

Faults: `cut(host)` stops its link carrying traffic, `kill(host)` kills every process in it, and a host created
with `impaired={"h1": (delay_ms, loss_percent)}` has a link that delays and drops frames: `tc qdisc netem` on its
veth where the kernel has netem, else a user-space link (tests/e2e/netns_link.py) of two TAP devices.
`close()` kills every process in the hosts and removes all of it, whatever happened.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = os.path.join(HERE, "netns_agent.sh")
LINK = os.path.join(HERE, "netns_link.py")
PREFIX = "csmn"  # namespace cs<pid>h<i>... are "csmn<pid>h<i>", the bridge "csmn<pid>b"


class Unsupported(Exception):
    """This machine cannot create the test hosts; the message says which command failed and how."""


def run(*cmd, check=True):
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise Unsupported(f"`{cmd[0]}` is not installed (Debian: iproute2, deploy/install_deps.sh)") from None
    if check and done.returncode != 0:
        raise Unsupported(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done


def _pids_in(namespace):
    out = run("ip", "netns", "pids", namespace, check=False).stdout.split()
    return [int(p) for p in out]


def _kill_all_in(namespace):
    # A process may fork while we kill: repeat until the namespace is empty.
    for _ in range(20):
        pids = _pids_in(namespace)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["sleep", "0.05"])


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def remove_leftovers():
    """Removes the namespaces and bridges of earlier test runs whose process is gone (killed before cleaning up)."""
    names = run("ip", "netns", "list", check=False).stdout.split()
    for name in names:
        m = re.fullmatch(PREFIX + r"(\d+)h\d+", name)
        if m and not _alive(int(m.group(1))):
            _kill_all_in(name)
            run("ip", "netns", "del", name, check=False)
    for line in run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        m = re.search(r"^\d+: (" + PREFIX + r"(\d+)[a-z]\w*)[@:]", line)
        if m and not _alive(int(m.group(2))):
            run("ip", "link", "del", m.group(1), check=False)


def tc_netem_available():
    """None when `tc qdisc ... netem` works here, else tc's error (e.g. "Specified qdisc kind is unknown.")."""
    probe = f"{PREFIX}{os.getpid()}p"
    run("ip", "link", "add", probe, "type", "veth", "peer", "name", f"{probe}q", check=False)
    try:
        done = run("tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms", check=False)
        return None if done.returncode == 0 else done.stderr.strip()
    finally:
        run("ip", "link", "del", probe, check=False)


class TestHosts:
    def __init__(self, slots, impaired=None):
        if os.geteuid() != 0:
            raise Unsupported("network namespaces need root (ip netns add), and this test runs as "
                              f"uid {os.geteuid()}")
        remove_leftovers()
        pid = os.getpid()
        self.tag = f"{PREFIX}{pid}"
        # 10.X.Y.0/24 from the pid: two tests running at once do not share a subnet.
        self.subnet = f"10.{100 + pid // 250 % 100}.{pid % 250}"
        self.cidr = f"{self.subnet}.0/24"
        self.bridge = f"{self.tag}b"
        self.hosts = {}  # name -> (address, root-side link)
        self.links = []  # user-space link processes
        self.impairment = None  # "tc netem" or "user-space link" once a host is impaired
        self._dir = tempfile.TemporaryDirectory(prefix=self.tag)
        self.hostfile = os.path.join(self._dir.name, "hostfile")
        self.agent = AGENT
        try:
            self._create(slots, impaired or {})
        except BaseException:
            self.close()
            raise

    def _create(self, slots, impaired):
        netem_error = tc_netem_available() if impaired else None
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        with open(self.hostfile, "w") as f:
            for i, name in enumerate(slots):
                namespace = f"{self.tag}h{i}"
                outer = f"{self.tag}v{i}"
                address = f"{self.subnet}.{11 + i}"
                run("ip", "netns", "add", namespace)
                self.hosts[name] = (namespace, address, outer)
                if name in impaired and netem_error is not None:
                    self._user_space_link(namespace, outer, *impaired[name])
                else:
                    run("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", namespace)
                run("ip", "link", "set", outer, "master", self.bridge, "up")
                inside = ("ip", "netns", "exec", namespace)
                run(*inside, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
                run(*inside, "ip", "link", "set", "eth0", "up")
                run(*inside, "ip", "link", "set", "lo", "up")
                if name in impaired and netem_error is None:
                    delay_ms, loss = impaired[name]
                    netem = ("qdisc", "add", "dev")
                    qdisc = ("root", "netem", "delay", f"{delay_ms}ms", "loss", f"{loss}%")
                    run("tc", *netem, outer, *qdisc)
                    run(*inside, "tc", *netem, "eth0", *qdisc)
                    self.impairment = "tc netem"
                f.write(f"{namespace} slots={slots[name]}\n")
        if impaired and netem_error is not None:
            self.impairment = f"user-space link (tc netem here: {netem_error})"

    def _user_space_link(self, namespace, outer, delay_ms, loss_percent):
        inner = f"{self.tag}i{len(self.links)}"
        link = subprocess.Popen([sys.executable, LINK, outer, inner, str(delay_ms), str(loss_percent)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.links.append(link)
        if link.stdout.readline().strip() != "ready":
            raise Unsupported(f"the user-space link {LINK} did not start: {link.stderr.read().strip()}")
        run("ip", "link", "set", inner, "netns", namespace)
        run("ip", "netns", "exec", namespace, "ip", "link", "set", inner, "name", "eth0")

    def namespace(self, host):
        return self.hosts[host][0]

    def address(self, host):
        return self.hosts[host][1]

    def launch_args(self, transport="tcp"):
        """deploy/launch.sh's host options for a job over these hosts."""
        return ["--hostfile", self.hostfile, "--agent", self.agent, "--iface", self.cidr, "--transport", transport]

    def cut(self, host):
        run("ip", "link", "set", self.hosts[host][2], "down")

    def kill(self, host):
        _kill_all_in(self.namespace(host))

    def close(self):
        for namespace, _, _ in self.hosts.values():
            _kill_all_in(namespace)
        for link in self.links:
            link.kill()
            link.wait()
            link.stdout.close()
            link.stderr.close()
        for namespace, _, outer in self.hosts.values():
            run("ip", "netns", "del", namespace, check=False)
            run("ip", "link", "del", outer, check=False)
        run("ip", "link", "del", self.bridge, check=False)
        self.hosts = {}
        self.links = []
        self._dir.cleanup()
