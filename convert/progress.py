"""What the person sees: a tqdm bar over the whole job, and a summary at the end."""

from __future__ import annotations

import shlex
import sys
import threading
import time


#: Seconds between progress lines where the output is not a terminal (a log file, CI, nohup).
LOG_INTERVAL_S = 30.0
#: Seconds of converting before a time left is estimated (the first shards finish in a burst).
ETA_AFTER_S = 5.0
#: Seconds between lines saying how far a listing is, on a terminal (elsewhere :data:`LOG_INTERVAL_S`); a
#: listing done sooner says nothing more than its phase's line.
LISTING_INTERVAL_S = 5.0


#: Held while a line is written (by any :class:`Progress`, from any thread).
_LINES = threading.Lock()


class Progress:
    """One bar over every sample of the run: images/s, MB/s written and the ETA (tqdm's). Where the output is
    not a terminal, a bar redrawn with carriage returns would make one endless line of a log: a plain line
    every :data:`LOG_INTERVAL_S` seconds (and one per phase) says the same."""

    def __init__(self, enabled: bool = True, file=None, log_interval: float = LOG_INTERVAL_S,
                 eta_after_s: float = ETA_AFTER_S):
        self.enabled, self.eta_after_s = enabled, eta_after_s
        self.file = file or sys.stderr
        isatty = getattr(self.file, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.log_interval = log_interval
        self._bar = None
        self._bytes = 0
        self._t0 = None
        self._total = self._done = 0
        self._desc = "converting"
        self._unit = "img"
        self._logged = 0.0
        self._said_at = time.perf_counter()  # when the last phase or listing line was said

    def _line(self, text: str) -> None:
        """One whole line, written at once: the split outputs' committing threads each say their phase, and
        ``print``'s separate writes of a text and its newline let two such lines run into one."""
        with _LINES:
            self.file.write(text + "\n")
            self.file.flush()

    def phase(self, text: str) -> None:
        """Say what the run is doing now (listing, starting Ray, finishing an LMDB...): the bar's label
        while the bar is up, else a line of its own, so the first seconds are never silent."""
        if not self.enabled:
            return
        self._said_at = time.perf_counter()
        if self._bar is not None:
            self._bar.set_description_str(text)
        elif self._t0 is not None and not self.tty:
            self._line(f"{text} ({self._counts()})")
        else:
            self._line(f"{text} ...")

    def listing(self, text: str) -> None:
        """How far a long listing is (``... 412 of 1,000 class tars indexed``): a line once
        :data:`LISTING_INTERVAL_S` (:data:`LOG_INTERVAL_S` where the output is not a terminal) have passed since
        the last one or the phase's, so a listing of ImageNet's tars on a few cores, or of a remote store, is not a
        silent minute."""
        if not self.enabled or self._bar is not None:
            return
        now = time.perf_counter()
        if now - self._said_at >= (LISTING_INTERVAL_S if self.tty else self.log_interval):
            self._said_at = now
            self._line(text)

    def converting(self) -> None:
        """Back to the bar's own label, once a phase shown on it (starting Ray) is over."""
        if self._bar is not None:
            self._bar.set_description_str(self._desc)

    def warn(self, text: str) -> None:
        """A one-line warning, shown even without a progress bar."""
        if self._bar is not None:
            self._bar.write(f"warning: {text}", file=self.file)
        else:
            self._line(f"warning: {text}")

    def start(self, total: int, already: int, unit: str = "img") -> None:
        self._t0 = self._logged = time.perf_counter()
        self._total, self._unit = total, unit
        if not self.enabled:
            return
        desc = self._desc = "converting" if not already else f"resuming ({already} samples already done)"
        if not self.tty:
            self._line(f"{desc}: {total:,} {unit}")
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit=unit, desc=desc, file=self.file, dynamic_ncols=True,
                         smoothing=0.1, mininterval=0.5)

    def update(self, samples: int, nbytes: int) -> None:
        self._bytes += nbytes
        self._done += samples
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self._bytes / elapsed / 1e6:.1f} MB/s", refresh=False)
            self._bar.update(samples)
        elif self.enabled and not self.tty and time.perf_counter() - self._logged >= self.log_interval:
            self._logged = time.perf_counter()
            self._line(f"{self._desc}: {self._counts()}")

    def _counts(self) -> str:
        """``12,000 of 120,000 img (10%), 2,400 img/s, 120.0 MB/s, about 45 s left`` so far."""
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        rate = self._done / elapsed
        text = (f"{self._done:,} of {self._total:,} {self._unit} ({100 * self._done / max(self._total, 1):.0f}%), "
                f"{rate:,.0f} {self._unit}/s since converting began, {self._bytes / elapsed / 1e6:.1f} MB/s")
        left = (self._total - self._done) / rate if rate > 0 else None
        # Said once the rate means something (a few seconds in), and never as "about 0 s" with work left.
        if left is not None and self._done < self._total and elapsed >= self.eta_after_s:
            text += f", about {left:.0f} s left" if left >= 1 else ", under a second left"
        return text

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def size_text(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _shown(name: str) -> str:
    """A path on one line, its control characters (a tab or newline in a file name) escaped as Python writes
    them, so a list of skipped inputs stays a line per input."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(name))


def format_summary(summary, max_skipped: int = 20) -> str:
    """The end-of-run report: samples per split and format, skipped inputs with reasons, bytes, time."""
    lines = []
    if summary.note:
        lines.append(summary.note)
    unit = getattr(summary, "unit", "images")
    for split, s in summary.samples.items():
        shards = s.get("shards", "?")
        shards = f"{shards} shard" + ("" if shards == 1 else "s")
        if getattr(summary, "dry_run", False):
            lines.append(f"{split}: {s['planned']} {unit} in {shards}")
            continue
        formats = ", ".join(f"{f} {n}" for f, n in s["formats"].items())
        lines.append(f"{split}: {s['written']} of {s['planned']} {unit} written in {shards} "
                     f"({formats}); {s['skipped']} skipped")
    # The summary's list holds what listing left out (never planned, so in no split's count) first, then the
    # planned inputs the conversion skipped (each split's "skipped").
    planned_skipped = 0 if getattr(summary, "dry_run", False) else sum(
        s.get("skipped", 0) for s in summary.samples.values())
    listing = max(0, len(summary.skipped) - planned_skipped)
    for title, entries in ((f"left out while listing ({listing}), in no count above:", summary.skipped[:listing]),
                           (f"skipped inputs ({len(summary.skipped) - listing}):", summary.skipped[listing:]),
                           (f"re-encoded inputs ({len(getattr(summary, 'converted', []))}), stored so that every "
                            "reader decodes them to 3 channels:", getattr(summary, "converted", []))):
        if entries:
            lines.append(title)
            lines.extend(f"  {_shown(origin)}: {reason}" for origin, reason in entries[:max_skipped])
            if len(entries) > max_skipped:
                lines.append(f"  ... and {len(entries) - max_skipped} more (all listed in manifest.json)")
    if summary.complete and summary.seconds:
        # The whole run's rate (listing, start-up and finishing included): the progress bar's is the
        # converting phase's, so it reads higher.
        lines.append(f"wrote {size_text(summary.bytes_written)} in {summary.seconds:.1f} s from start to finish: "
                     f"{summary.images_per_second:.0f} {unit}/s, "
                     f"{summary.bytes_written / summary.seconds / 1e6:.1f} MB/s over the whole run")
    norm = getattr(summary, "normalization", None) or {}
    if norm.get("mean_binaryproto_skipped"):
        lines.append(f"no mean.binaryproto: {norm['mean_binaryproto_skipped']}")
    if summary.complete:
        lines.append(f"output: {summary.out} (manifest.json lists every file; check it with "
                     f"`gpufeed verify {shlex.quote(summary.out)}`)")
    return "\n".join(lines)
