"""A process outside raygpt and outside Ray that takes the node's memory, for
tests/ray_seam/test_memory_kill.py: `python memory_hog.py FAST_UNTIL PID...` grows fast while
the node uses less than FAST_UNTIL bytes (MemTotal - MemAvailable, Ray's measure), then by CHUNK
every PAUSE_S while every PID lives (raygpt's workers): the node crosses Ray's memory line by
less than one worker holds, so one kill brings it back under. Once Ray's monitor has killed one
of them, it prints how much it holds and holds it until it is killed. Ray cannot kill it: it is
no Ray worker."""

import signal
import sys
import time

CHUNK = 16 << 20
PAUSE_S = 0.02


def node_used() -> int:
    kib = {line.split(":")[0]: int(line.split()[1])
           for line in open("/proc/meminfo").read().splitlines()}
    return (kib["MemTotal"] - kib["MemAvailable"]) << 10


def alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its parent's wait() has died)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def main(fast_until: int, pids: list[int]) -> None:
    held = []
    while all(alive(p) for p in pids):
        held.append(bytearray(b"\x01") * CHUNK)  # written, so resident: bytearray(n) is not
        if node_used() > fast_until:
            time.sleep(PAUSE_S)
    print(f"hog holds {len(held) * CHUNK} bytes", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(p) for p in sys.argv[2:]])
