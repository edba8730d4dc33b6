"""What the person sees: a tqdm bar over the whole job, and a summary at the end."""

from __future__ import annotations

import sys
import time


class Progress:
    """One bar over every sample of the run: images/s, MB/s written and the ETA (tqdm's)."""

    def __init__(self, enabled: bool = True, file=None):
        self.enabled = enabled
        self.file = file or sys.stderr
        self._bar = None
        self._bytes = 0
        self._t0 = None

    def phase(self, text: str) -> None:
        """Say what the run is doing now (listing, starting Ray, finishing an LMDB...): the bar's label
        while the bar is up, else a line of its own, so the first seconds are never silent."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description_str(text)
        else:
            print(f"{text} ...", file=self.file, flush=True)

    def converting(self) -> None:
        """Back to the bar's own label, once a phase shown on it (starting Ray) is over."""
        if self._bar is not None:
            self._bar.set_description_str(self._desc)

    def warn(self, text: str) -> None:
        """A one-line warning, shown even without a progress bar."""
        if self._bar is not None:
            self._bar.write(f"warning: {text}", file=self.file)
        else:
            print(f"warning: {text}", file=self.file, flush=True)

    def start(self, total: int, already: int, unit: str = "img") -> None:
        self._t0 = time.perf_counter()
        if not self.enabled:
            return
        from tqdm import tqdm

        desc = self._desc = "converting" if not already else f"resuming ({already} samples already done)"
        self._bar = tqdm(total=total, unit=unit, desc=desc, file=self.file, dynamic_ncols=True,
                         smoothing=0.1, mininterval=0.5)

    def update(self, samples: int, nbytes: int) -> None:
        self._bytes += nbytes
        if self._bar is None:
            return
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        self._bar.set_postfix_str(f"{self._bytes / elapsed / 1e6:.1f} MB/s", refresh=False)
        self._bar.update(samples)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


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
    if summary.skipped:
        lines.append(f"skipped inputs ({len(summary.skipped)}):")
        for origin, reason in summary.skipped[:max_skipped]:
            lines.append(f"  {origin}: {reason}")
        if len(summary.skipped) > max_skipped:
            lines.append(f"  ... and {len(summary.skipped) - max_skipped} more (all listed in manifest.json)")
    converted = getattr(summary, "converted", [])
    if converted:
        lines.append(f"re-encoded inputs ({len(converted)}), stored so that every reader decodes them to 3 channels:")
        for origin, reason in converted[:max_skipped]:
            lines.append(f"  {origin}: {reason}")
        if len(converted) > max_skipped:
            lines.append(f"  ... and {len(converted) - max_skipped} more (all listed in manifest.json)")
    if summary.complete and summary.seconds:
        lines.append(f"wrote {_size(summary.bytes_written)} in {summary.seconds:.1f} s: "
                     f"{summary.images_per_second:.0f} {unit}/s, "
                     f"{summary.bytes_written / summary.seconds / 1e6:.1f} MB/s")
    if summary.complete:
        lines.append(f"output: {summary.out} (manifest.json lists every file; check it with "
                     f"`gpufeed verify {summary.out}`)")
    return "\n".join(lines)
