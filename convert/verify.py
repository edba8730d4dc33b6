"""``gpufeed verify DST``: read every output back and check it against ``manifest.json``.

In order, stopping at the first problem (named, with the fix): the manifest is there (else the conversion
did not finish); every file it lists exists with its size and SHA-256; every record of every output reads
back through the format's own reader (which checks CRCs, framing, Datum fields); the record counts match
the manifest; each split's labels are the same in every format and in the files that list the samples apart
from the records (:meth:`Format.listed_labels`); every image decodes. Outputs are checked in parallel by a
local process pool, one output file per task.
"""

from __future__ import annotations

import collections
import dataclasses
import os

from gpufeed import io
from gpufeed.convert.destination import check_entries
from gpufeed.errors import (ConfigError, CorruptRecordError, IncompleteOutputError, ShardNotFound, SourceNotFound,
                            make_readable)
from gpufeed.formats.base import label_key
from gpufeed.machine import usable_cores

#: The fix for a missing file: a rerun finds the output incomplete and converts it again.
RERUN = "rerun the same gpufeed convert command"
#: The fix for a file changed since it was written: a conversion removes or overwrites only files it can prove
#: it wrote (:mod:`gpufeed.convert.destination`), and a plain rerun finds this one at its recorded size. Once it
#: is gone, the rerun finds the output incomplete.
DAMAGED = f"delete it, then {RERUN} (gpufeed never removes a file that changed since it wrote it)"
DAMAGED_ALL = f"delete those that are there, then {RERUN} (gpufeed never removes a file that changed since it wrote it)"
#: The fix for an output whose files are as the manifest records them but whose records are not: every file
#: is then proven gpufeed's, so converting again replaces them.
AGAIN = "convert again: rerun the same gpufeed convert command with --no-resume"
#: The fix for a file that is there but cannot be read: nothing is known to be wrong with it yet.
READABLE = f"{make_readable()}, then verify again"


def add_arguments(p) -> None:
    p.add_argument("out", metavar="DST", help="a destination written by `gpufeed convert`")
    p.add_argument("--workers", type=int, default=usable_cores(), help="parallel checking processes")
    p.add_argument("--no-decode", dest="decode", action="store_false",
                   help="skip decoding every image (framing, checksums, counts and labels are still checked)")


def run(args) -> int:
    report = verify(args.out, workers=args.workers, decode=args.decode)
    print(report.text())
    return 0


@dataclasses.dataclass
class Report:
    out: str
    files: int
    records: dict  # (split, format) -> records read back
    images_decoded: int
    pixels_checked: int = 0  # raw pixel records checked as tensors (shape, dtype, finite values)
    decode: bool = True  # whether encoded images were decoded (--no-decode: not)

    def text(self) -> str:
        per = ", ".join(f"{s}/{f} {n}" for (s, f), n in sorted(self.records.items()))
        said = [f"{self.out}: OK: {self.files} files match their checksums", f"records read back: {per}"]
        if self.images_decoded:
            said.append(f"{self.images_decoded} images decode")
        elif not self.decode:
            said.append("images not decoded (--no-decode)")
        if self.pixels_checked:
            said.append(f"{self.pixels_checked} raw pixel records have the stored shape, dtype and finite values")
        return "; ".join(said)


@dataclasses.dataclass(frozen=True)
class _Output:
    format: str
    path: str  # what the format's reader opens
    split: str
    records: int
    dtype: str = "uint8"  # what raw pixels must be stored as (--store-dtype)


def _check_file(out: str, entry: dict) -> None:
    from gpufeed.convert.destination import UNREADABLE, file_problem

    url = io.join(out, entry["path"])
    problem = file_problem(url, entry)
    if problem == "missing":
        raise ShardNotFound(url, RERUN)
    if problem is not None and problem.startswith(UNREADABLE):
        raise IncompleteOutputError(f"{url}: {problem}; {READABLE}")
    if problem is not None:
        raise IncompleteOutputError(f"{url}: {problem} (against manifest.json); {DAMAGED}")


def _check_output(o: _Output, decode: bool) -> tuple[int, int, int, dict]:
    """Read one output whole; ``(records, images decoded, raw pixel records checked, {label: count})``. Raises
    on the first defect."""
    from gpufeed.formats import get_format
    from gpufeed.pipelines.transforms import decode_image

    if get_format(o.format).local_only and not io.is_local(o.path):
        return _check_remote_local_only(o, decode)
    counts = collections.Counter()
    n = decoded = pixels = 0
    reader = get_format(o.format).reader(o.path)
    try:
        for sample in reader:
            counts[label_key(sample.labels)] += 1
            if decode and sample.kind == "encoded":
                decode_image(bytes(sample.payload), f"{o.path} record {n} ({sample.key})", max_pixels=2**62)
                decoded += 1
            elif sample.kind == "raw":
                _check_pixels(o, n, sample)
                pixels += 1
            n += 1
    finally:
        reader.close()
    return n, decoded, pixels, dict(counts)


def _check_pixels(o: _Output, n: int, sample) -> None:
    """Raw pixels: an HWC array of the stored dtype with 1 or 3 channels, and for floats no NaN or inf."""
    import numpy as np

    px = np.asarray(sample.payload)
    if px.ndim != 3 or px.shape[2] not in (1, 3) or px.dtype.name != o.dtype:
        raise CorruptRecordError(o.path, n, None, f"raw pixels of shape {px.shape} and dtype {px.dtype}, not an "
                                                  f"HxWx(1|3) {o.dtype} image as the manifest's options say")
    if px.dtype.kind == "f" and not np.isfinite(px).all():
        raise CorruptRecordError(o.path, n, None, "normalised pixels hold NaN or infinity")


def _check_remote_local_only(o: _Output, decode: bool) -> tuple[int, int, int, dict]:
    """A format that reads local paths only (LMDB maps its file): a remote output is read from a local copy."""
    import tempfile

    fs, remote = io.url_to_fs(o.path)
    with tempfile.TemporaryDirectory(prefix="gpufeed-verify-") as tmp:
        local = os.path.join(tmp, os.path.basename(remote.rstrip("/")))
        os.mkdir(local)
        for name in fs.ls(remote, detail=False):
            fs.get(name, os.path.join(local, os.path.basename(name)))
        return _check_output(dataclasses.replace(o, path=local), decode)


def _outputs(out: str, manifest: dict, formats: list) -> tuple[list[_Output], list[str]]:
    """The outputs a manifest lists, each as the reader of its format (one of ``formats``) opens it, and the files
    that list samples apart from the records (role "list")."""
    outputs, lists = [], []
    dtype = (manifest.get("output_options") or {}).get("store_dtype") or "uint8"
    for f in manifest["files"]:
        if f["role"] == "list":
            lists.append(f["path"])
        if f["role"] != "data":
            continue
        for fmt in formats:
            if f.get("format") not in (None, fmt.name):
                continue  # the manifest says which format wrote it (manifests before it said: by name)
            split = fmt.parse_output(f["path"])
            if split is not None:
                path = io.join(out, *fmt.reader_path(f["path"]).split("/"))
                outputs.append(_Output(fmt.name, path, split, f["records"], dtype))
                break
    return outputs, lists


def verify(out: str, workers: int = 1, decode: bool = True) -> Report:
    """Check ``out`` completely; raise the first problem as a gpufeed error, else return a report."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from gpufeed.convert import manifest as manifest_mod
    from gpufeed.formats import FORMATS, get_format

    out = out.rstrip("/") if not io.is_local(out) else io.local_path(out)
    if io.is_local(out) and os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"{out} is a file; gpufeed verify checks the folder a gpufeed convert run wrote (its "
                          "--out), which holds manifest.json")
    try:
        manifest = manifest_mod.load(out)
    except manifest_mod.NotAManifest as e:
        raise IncompleteOutputError(f"{manifest_mod.path(out)}: {e}; gpufeed does not read or overwrite it: move it "
                                    f"away, then {RERUN}") from None
    except ValueError as e:
        raise IncompleteOutputError(f"{manifest_mod.path(out)}: not valid JSON ({e}); gpufeed does not overwrite a "
                                    f"manifest it cannot read: delete it, then {RERUN}") from None
    if manifest is None and io.is_local(out) and not os.path.isdir(out):
        raise SourceNotFound(out, "a conversion output (folder)", "give the --out of a gpufeed convert run")
    if manifest is not None and not (isinstance(manifest, dict) and "manifest_version" in manifest):
        raise IncompleteOutputError(f"{manifest_mod.path(out)}: not a gpufeed manifest (a JSON "
                                    f"{type(manifest).__name__} without manifest_version); gpufeed does not overwrite a "
                                    f"manifest it did not write: move it away, then {RERUN}")
    if manifest is None and not _conversion_started(out):
        raise SourceNotFound(out, "a gpufeed convert output (no manifest.json, no conversion's state or format "
                             "folders)", "give the --out of a gpufeed convert run")
    if manifest is None:
        raise IncompleteOutputError(f"{manifest_mod.path(out)}: missing, so the conversion did not finish; rerun "
                                    "the same gpufeed convert command to complete it")
    if manifest.get("manifest_version") != manifest_mod.MANIFEST_VERSION:
        raise IncompleteOutputError(f"{manifest_mod.path(out)}: manifest version "
                                    f"{manifest.get('manifest_version')} is not {manifest_mod.MANIFEST_VERSION}; "
                                    "verify it with the gpufeed version that wrote it")
    check_entries(out, manifest.get("files"), manifest_mod.path(out))
    if not isinstance(manifest.get("splits"), dict) or not isinstance(manifest.get("formats"), list):
        raise IncompleteOutputError(f"{manifest_mod.path(out)}: its splits or formats are missing; the file was "
                                    f"edited or is not gpufeed's: move it away, then {RERUN}")
    formats = [get_format(name) for name in FORMATS]
    outputs, lists = _outputs(out, manifest, formats)
    if out.startswith("memory://"):
        workers = 1  # a memory:// filesystem exists only in this process
    pool = None
    if workers > 1:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        run = (lambda fn, *args: pool.submit(fn, *args)) if pool else _Done
        _raise_all([run(_check_file, out, f) for f in manifest["files"]], out)
        results = [(o, run(_check_output, o, decode)) for o in outputs]
        records, labels, decoded, pixels = collections.Counter(), {}, 0, 0
        for o, fut in results:
            n, d, p, counts = fut.result()
            if n != o.records:
                raise IncompleteOutputError(f"{o.path}: {n} records read back, the manifest says {o.records}; "
                                            f"{AGAIN}")
            records[(o.split, o.format)] += n
            decoded, pixels = decoded + d, pixels + p
            labels.setdefault((o.split, o.format), collections.Counter()).update(counts)
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    for rel in lists:
        for fmt in formats:
            listed = fmt.listed_labels(out, rel)
            if listed is not None:
                split, counts = listed
                name = f"{fmt.name} .{rel.rsplit('.', 1)[-1]}"  # "recordio .lst"
                labels.setdefault((split, name), collections.Counter()).update(counts)
                break
    for split, info in manifest["splits"].items():
        for fmt in manifest["formats"]:
            got = records.get((split, fmt), 0)
            if got != info["written"]:
                raise IncompleteOutputError(f"{out}/{fmt}: the {split} split has {got} records, the manifest says "
                                            f"{info['written']} samples were written; {AGAIN}")
        per_split = {f: c for (s, f), c in labels.items() if s == split}
        if per_split:
            first_fmt, first = next(iter(per_split.items()))
            for fmt, c in per_split.items():
                if c != first:
                    raise IncompleteOutputError(f"{out}: the {split} split's labels differ between {first_fmt} "
                                                f"and {fmt}; the outputs are not from one conversion: {AGAIN}")
    return Report(out, len(manifest["files"]), dict(records), decoded, pixels, decode)


def _conversion_started(out: str) -> bool:
    """Whether a conversion wrote into ``out`` (its state directory or a format's folder), so that a missing
    manifest means it did not finish, rather than that ``out`` is some other folder."""
    from gpufeed.convert.state import state_dir_for
    from gpufeed.formats import FORMATS

    return io.exists(state_dir_for(out)) or any(io.exists(io.join(out, f)) for f in FORMATS)


def _raise_all(checks: list, out: str) -> None:
    """Every file's check done: one damaged file raises its own error; several, one error listing them all
    (a user mending a large output wants the whole list from one pass over it)."""
    problems = []
    for fut in checks:
        try:
            fut.result()
        except (IncompleteOutputError, ShardNotFound) as e:
            problems.append(e)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        lines = [str(e).removesuffix(f"; {RERUN}").removesuffix(f"; {DAMAGED}").removesuffix(f"; {READABLE}")
                 for e in problems]
        unread = sum(str(e).endswith(f"; {READABLE}") for e in problems)
        what = "do not match manifest.json"
        fix = RERUN if all(isinstance(e, ShardNotFound) for e in problems) else DAMAGED_ALL
        if unread == len(problems):
            what, fix = "cannot be read", f"{make_readable('them')}, then verify again"
        elif unread:
            what = f"cannot be read or {what}"
            fix = f"{make_readable('those that cannot be read')}; of the others, {fix}"
        raise IncompleteOutputError(f"{out}: {len(problems)} of {len(checks)} files {what}; {fix}:\n"
                                    + "\n".join(f"  {line}" for line in lines))


class _Done:
    """The outcome of a call made in this process, with a future's ``result()``."""

    def __init__(self, fn, *args):
        self.value, self.error = None, None
        try:
            self.value = fn(*args)
        except Exception as e:
            self.error = e

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value
