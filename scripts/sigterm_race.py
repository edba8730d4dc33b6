"""Stress check for gpufeed.machine.fork_pool: make a pool and terminate it at once, N times, under a SIGTERM
handler that raises (as a Ray driver's does), and count the pools whose terminate() did not return within 10 s
(a worker that lost the SIGTERM in the fork's own hooks and waits on the queue's lock for good; each is killed).

    python scripts/sigterm_race.py 1000        # beside two busy loops on 2 cores: 7 hung before sigterm_held, 0 after
"""

import os
import signal
import sys
import threading
import time

from gpufeed.machine import fork_pool


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    hung = 0
    for i in range(runs):
        pool = fork_pool(2)
        if i % 2:
            time.sleep(0.001 * (i % 7))  # some terminated as they start, some a little later
        procs = list(pool._pool)
        done = threading.Event()
        threading.Thread(target=lambda: (pool.terminate(), done.set()), daemon=True).start()
        if not done.wait(10):
            hung += 1
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            done.wait(10)
    print(f"runs {runs}, terminate() hung {hung}")


if __name__ == "__main__":
    main()
