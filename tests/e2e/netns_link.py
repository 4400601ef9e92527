"""A network link with delay and loss, in user space, for kernels without tc's netem qdisc.

`netns_link.py OUTER INNER DELAY_MS LOSS_PERCENT` creates two TAP devices and forwards every Ethernet frame from
one to the other after DELAY_MS, dropping each with probability LOSS_PERCENT / 100 (the same in both directions,
like `tc qdisc add ... netem delay DELAY_MS loss LOSS_PERCENT` on both ends of a veth pair). It prints "ready" once
both devices exist; the caller then moves INNER into a namespace and attaches OUTER to a bridge. Runs until killed.
"""

import collections
import fcntl
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def open_tap(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main():
    outer, inner, delay_ms, loss_percent = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    delay, loss = delay_ms / 1000.0, loss_percent / 100.0
    fds = [open_tap(outer), open_tap(inner)]
    peer = {fds[0]: fds[1], fds[1]: fds[0]}
    # Frames in flight, oldest first (a constant delay keeps each direction in order): (due, destination, frame).
    in_flight = collections.deque()
    print("ready", flush=True)
    while True:
        timeout = max(0.0, in_flight[0][0] - time.monotonic()) if in_flight else None
        readable, _, _ = select.select(fds, [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            while True:
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if random.random() >= loss:
                    in_flight.append((now + delay, peer[fd], frame))
        while in_flight and in_flight[0][0] <= time.monotonic():
            _, fd, frame = in_flight.popleft()
            try:
                os.write(fd, frame)
            except OSError:
                pass  # the device is down or its queue full: the frame is lost, as on a wire


if __name__ == "__main__":
    main()
