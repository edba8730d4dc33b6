"""What every consumer check shares (standard library only: it runs under each consumer's interpreter)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback


class Checks:
    """Counts passed and failed checks; failures are printed as they happen and summed up at the end."""

    def __init__(self, consumer: str, root: str):
        self.consumer = consumer
        self.root = os.path.abspath(root)
        with open(os.path.join(self.root, "expected.json")) as f:
            self.expected = json.load(f)
        self.passed = 0
        self.failed: list[str] = []

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def check(self, ok: bool, what: str) -> bool:
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
            print(f"FAIL {what}", flush=True)
        return ok

    def equal(self, got, want, what: str) -> bool:
        return self.check(got == want, f"{what}: consumer gives {got!r}, gpufeed wrote {want!r}")

    def run(self, name: str, fn, *args) -> None:
        """One group of checks; an exception from the consumer is a failure of that group, not a crash."""
        before = len(self.failed)
        try:
            fn(*args)
        except Exception as e:  # the consumer rejecting our file is exactly what is being looked for
            traceback.print_exc()
            self.failed.append(f"{name}: {type(e).__name__}: {e}")
        print(f"{'ok  ' if len(self.failed) == before else 'FAIL'} {name}", flush=True)

    def class_label(self, dataset: str, name: str):
        """The class index implied by an ImageNet name ``<wnid>/<wnid>_N.JPEG`` and ``classes.txt``."""
        classes = self.expected["classes"].get(dataset)
        wnid = name.split("/")[0]
        return None if classes is None or wnid not in classes else classes[wnid]

    def finish(self, versions: str) -> None:
        status = "FAIL" if self.failed or not self.passed else "PASS"
        print(f"{status} {self.consumer} ({versions}): {self.passed} checks passed, {len(self.failed)} failed")
        for what in self.failed:
            print(f"  - {what}")
        sys.exit(status != "PASS")


def sha256(data) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


def dataset_of(rel: str) -> str:
    return rel.split("/")[0]
