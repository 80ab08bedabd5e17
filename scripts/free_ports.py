"""Print N TCP ports free on 127.0.0.1 now, one line, space-separated (for a private Slurm's daemons: .ci/run)."""

import socket
import sys


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]  # all held open together, so the ports differ
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


if __name__ == "__main__":
    print(*free_ports(int(sys.argv[1])))
