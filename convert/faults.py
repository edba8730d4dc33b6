"""Test-only fault injection for conversion workers, kept out of the worker's own code: the tests' faults
cross into processes no fixture reaches (Ray workers are started by the raylet, local ones by a fork server),
so the driver reads them from the environment (:func:`from_env`) and hands them to each shard in its job.
Without them, a shard pays one ``None`` check per input.
"""

from __future__ import annotations

import os
import time

#: A JSON object with ``fsize`` (a file size limit, RLIMIT_FSIZE, applied while a shard runs: the condition a
#: full disk creates), ``crash_on`` (inputs whose origin ends with this string kill their worker, like a
#: crashing decoder) and/or ``delay_s`` (seconds each input takes longer, so a test can act while a run is busy).
TEST_FAULTS_ENV = "GPUFEED_TEST_FAULTS"


def from_env() -> dict | None:
    import json

    text = os.environ.get(TEST_FAULTS_ENV)
    return json.loads(text) if text else None


class FileSizeLimit:
    """The ``fsize`` fault: lower the soft RLIMIT_FSIZE for one shard, then restore it (workers are reused).
    Python ignores SIGXFSZ, so a write past the limit fails with EFBIG, as on a full disk."""

    def __init__(self, faults: dict | None):
        self.limit = (faults or {}).get("fsize")
        self.saved = None

    def __enter__(self):
        if self.limit is not None:
            import resource

            self.saved = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(self.limit), self.saved[1]))

    def __exit__(self, *exc):
        if self.saved is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, self.saved)


def before_item(faults: dict | None, item, shard: int | None = None) -> None:
    """The ``delay_s``, ``stall_shard`` (``[shard, seconds]``: each input of that shard that much slower) and
    ``crash_on`` faults, before an input of ``shard`` is converted."""
    if not faults:
        return
    if faults.get("delay_s"):
        time.sleep(faults["delay_s"])
    if faults.get("stall_shard") and faults["stall_shard"][0] == shard:
        time.sleep(faults["stall_shard"][1])
    crash_on = faults.get("crash_on")
    if crash_on and item.origin.endswith(crash_on):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
