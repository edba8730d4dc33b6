"""Everything a conversion run depends on, validated once, in one frozen dataclass.

The options that change the output bytes (:meth:`ConvertOptions.output_key`) are journalled by the first
run; a resumed run must match them exactly. The others (workers, cluster address, resume, dry run) only
change how fast or where the work runs, never what is written.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat

from gpufeed.errors import ConfigError
from gpufeed.formats import FORMATS
from gpufeed.io import canonical, kind_of
from gpufeed.machine import usable_cores
from gpufeed.pipelines import DATASETS, ON_ERROR
from gpufeed.pipelines.image_options import GEOMETRY, ImageOptions

PTB_MODES = ("window", "sentence")
#: A shard holds about this many samples when ``--shards`` is not given, as TensorFlow's ImageNet
#: script does (1024 train shards of ~1250 images): large enough for sequential reads, small enough that
#: a shard is a cheap unit of retry and resume.
SAMPLES_PER_SHARD = 1250
#: Where every output is one file per split appended shard after shard (RecordIO without ``--shards``), no shard
#: is a file anyone sees, and the shards are only units of work and resume: a quarter of the size by default, so
#: that the last wave, which leaves workers idle while its shards finish, is short. 128 shards of 1,172 images on
#: 32 workers (whole waves on paper) left 58-61 worker-seconds idle in the last one, ~1.8 s of a 20 s warm run
#: (results/convert-node-h100x2.txt); a shard more costs its worker ~2.5 ms.
ASSEMBLED_SAMPLES_PER_SHARD = SAMPLES_PER_SHARD // 4

#: Options that do not change a single byte of a finished shard, left out of the resume check.
#: ``on_error`` is one: a shard finished under ``fail`` skipped nothing, one finished under ``skip`` lists
#: its skipped inputs in the journal, and either stays as it is when the run goes on under the other.
_RUNTIME_ONLY = ("workers", "address", "resume", "overwrite", "allow_incomplete", "strict", "dry_run",
                 "progress", "driver_writes", "task_retries", "on_error", "local_start", "executor")
#: Output options that name a place, compared by :func:`gpufeed.io.canonical` (not as spelled).
PATH_OPTIONS = ("src", "root")
#: Retries of a shard whose worker process or node died (not of errors the task raises itself).
TASK_RETRIES = 3
#: ``--executor`` choices (ConvertOptions.executor).
EXECUTORS = ("auto", "pool", "ray")


def canonical_places(options: dict) -> dict:
    """Output options by name (:meth:`ConvertOptions.output_key`, or as a journal or manifest recorded them)
    with the options that name a place (:data:`PATH_OPTIONS`) in their canonical spelling; a synthetic
    dataset's SRC names what to make (KIND:N[:SEED]), no place, and stays as given."""
    places = PATH_OPTIONS if options.get("dataset") != "synthetic" else ()
    return {k: canonical(v) if k in places and v is not None else v for k, v in options.items()}


def _choice(name: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{name} {value!r} is not valid; choose one of {', '.join(map(str, valid))}")


def _image_options_asked() -> ImageOptions:
    """A conversion's image options by default: nothing changed, the encoding chosen from the dataset."""
    return ImageOptions(encode=None)


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """One conversion: ``DATASET`` at ``src`` to ``formats`` under ``out``, each image stored as ``image`` asks
    (:class:`~gpufeed.pipelines.image_options.ImageOptions`, checked there; ``encode=None``, the default:
    chosen from the others and the dataset, :attr:`effective_encode`)."""

    dataset: str
    src: str  # the dataset as shipped; for ``folder``, also an im2rec ``.lst`` or Caffe list file
    formats: tuple[str, ...]
    out: str
    image: ImageOptions = dataclasses.field(default_factory=_image_options_asked)
    root: str | None = None  # where a list file's relative paths start (default: the list file's folder)
    workers: int = dataclasses.field(default_factory=usable_cores)
    splits: tuple[str, ...] | None = None
    label_offset: int = 0  # added to TFRecord class labels: 1 gives TensorFlow's 1..1000 (0 = background)
    normalize: bool = False
    shards: int | None = None
    shard_size: int | None = None  # samples per shard; None: SAMPLES_PER_SHARD, small splits cut finer (plan)
    shard_bytes: int | None = None  # instead of shard_size: about this many input bytes per shard
    limit: int | None = None  # convert only this many inputs of each split (a seeded sample)
    shuffle: bool | None = None
    seed: int = 0
    on_error: str = "fail"
    address: str | None = None
    resume: bool = True
    overwrite: bool = False  # replace a finished conversion made with other options (its files removed first)
    allow_incomplete: bool = False  # convert an ImageNet / CIFAR / PTB source that lacks what the dataset ships
    strict: bool = False  # identify every input by a checksum of its bytes too (a resume then notices any edit)
    dry_run: bool = False
    seq_len: int = 35
    ptb_mode: str = "window"
    progress: bool = True
    driver_writes: bool = False
    task_retries: int = TASK_RETRIES
    #: Convert the first shards in local processes while a local Ray runtime starts (scheduler._LocalStart).
    #: The command line turns it on; it is off for callers of the Python API, because those processes come
    #: from a fork server, which a library should not start in a process it does not own (a script without
    #: a ``__main__`` guard would be run again in each of them).
    local_start: bool = False
    #: What converts the shards on a runtime started here (``local_start`` on, no ``address``): ``pool``, the
    #: local processes, for the whole run, with a local Ray runtime started only for a shard whose process
    #: died (its retries and bisection then deal with it, and Ray takes the rest of the run); ``ray``, Ray's workers
    #: once Ray is up; ``auto``, the pool. A cluster (``address``) and a runtime this process already runs
    #: always use Ray.
    executor: str = "auto"

    @property
    def pool_converts(self) -> bool:
        """Whether local processes convert every shard they can (``executor`` resolved for this run)."""
        return self.local_start and not self.address and self.executor in ("auto", "pool")

    def __post_init__(self):
        _choice("dataset", self.dataset, DATASETS)
        if not self.formats:
            raise ConfigError(f"--to needs at least one format; choose from {', '.join(FORMATS)}")
        for f in self.formats:
            _choice("format", f, FORMATS)
        if len(set(self.formats)) != len(self.formats):
            raise ConfigError(f"--to names a format twice: {','.join(self.formats)}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"--seed must be a whole number 0 or more, not {self.seed}")
        if self.task_retries < 0:
            raise ConfigError(f"--task-retries must be 0 or more, not {self.task_retries}")
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, not {self.workers}")
        _choice("--on-error", self.on_error, ON_ERROR)
        _choice("--executor", self.executor, EXECUTORS)
        if self.executor == "pool" and self.address:
            raise ConfigError(f"--executor pool converts on this machine; --address {self.address} runs every shard "
                              "on that Ray cluster: give one of them")
        _choice("--ptb-mode", self.ptb_mode, PTB_MODES)
        if self.label_offset not in (0, 1):
            raise ConfigError(f"--label-offset must be 0 (0-based labels) or 1 (TensorFlow's 1..1000 with 0 = "
                              f"background), not {self.label_offset}")
        if self.label_offset:
            from gpufeed.formats import format_class

            takers = [name for name in FORMATS if format_class(name).takes_label_offset]
            if not set(takers) & set(self.formats):
                raise ConfigError(f"--label-offset applies to {', '.join(takers)} labels; add "
                                  f"{' or '.join(takers)} to --to or leave it out")
        if not isinstance(self.image, ImageOptions):
            raise ConfigError(f"image={self.image!r}: give the image options as an ImageOptions "
                              "(gpufeed.pipelines.image_options)")
        if self.shards is not None and self.shards < 1:
            raise ConfigError(f"--shards must be at least 1, not {self.shards}")
        if self.shard_size is not None and self.shard_size < 1:
            raise ConfigError(f"--shard-size must be at least 1, not {self.shard_size}")
        if self.shard_bytes is not None and self.shard_bytes < 1:
            raise ConfigError(f"--shard-bytes must be a positive size, e.g. 256MB, not {self.shard_bytes}")
        if self.shard_bytes is not None and self.shards is not None:
            raise ConfigError("--shards and --shard-bytes both set the shard count; give one")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be at least 1 input per split, not {self.limit}")
        if self.seq_len < 1:
            raise ConfigError(f"--seq-len must be at least 1, not {self.seq_len}")
        if self.text:
            image = [f"--{n.replace('_', '-')}" for n in (*GEOMETRY, "gray", "encode") if getattr(self.image, n)]
            image += ["--normalize"] * self.normalize
            if image:
                raise ConfigError(f"{', '.join(image)} transform images; Penn Treebank is text (token records): "
                                  "drop them (--seq-len and --ptb-mode shape its records)")
        self._check_src_kind()
        self._check_list_file()
        self._check_store_dtype()
        if self.splits is not None and not self.splits:
            raise ConfigError("--split needs at least one split name, e.g. train,val")
        self._check_out_not_in_src()

    @property
    def text(self) -> bool:
        """Whether the dataset is text (token records): Penn Treebank, or synthetic windows of it."""
        return self._kind == "ptb"

    @property
    def cifar(self) -> bool:
        """Whether the dataset is CIFAR's 32x32 pixels (CIFAR-10/100, or synthetic pixels like them)."""
        return self._kind == "cifar"

    @property
    def _kind(self) -> str:
        if self.dataset == "synthetic":
            from gpufeed.pipelines.sources_synthetic import parse_spec

            return parse_spec(self.src)[0]
        return {"ptb": "ptb", "cifar10": "cifar", "cifar100": "cifar"}.get(self.dataset, "images")

    @property
    def src_is_place(self) -> bool:
        """Whether SRC names a place (a path or URL), not what to make (``synthetic``'s KIND:N[:SEED])."""
        return self.dataset != "synthetic"

    @property
    def list_file(self) -> str | None:
        """SRC when it is a list file (``folder`` only): an im2rec ``.lst`` or a Caffe ``path label`` list."""
        if self.dataset != "folder" or "://" in self.src or not os.path.isfile(self.src):
            return None
        return self.src

    @property
    def source_root(self) -> str:
        """Where the inputs are: SRC, or for a list file ``--root`` (default: the list file's folder)."""
        if self.list_file is None:
            return self.src
        return self.root if self.root is not None else (os.path.dirname(os.path.abspath(self.src)))

    def _check_src_kind(self) -> None:
        """A local SRC is a folder or a file (links followed): a pipe (a list given as ``<(...)``), a FIFO or a
        device was taken for a folder that is missing, or a list file that is not one."""
        if not self.src_is_place or "://" in self.src:
            return
        try:
            mode = os.stat(self.src).st_mode
        except OSError:
            return  # (missing: the source says so, naming what it looked for)
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ConfigError(f"SRC {self.src} is {kind_of(mode)}, not a file or folder: a source is read again by "
                              "each rerun that resumes a run, and a list file's name names its split (train.lst "
                              "converts to train), so save it to a file and give that")

    def _check_list_file(self) -> None:
        # A file SRC is an archive the dataset ships as (CIFAR's .tar.gz, PTB's .tgz), which its source reads;
        # a list file (.lst, Caffe's .txt) for ImageNet or CIFAR was meant for the folder dataset.
        looks_like_list = ("://" not in self.src and os.path.isfile(self.src)
                           and self.src.endswith((".lst", ".txt")))
        if looks_like_list and self.dataset not in ("folder", "ptb"):
            raise ConfigError(f"SRC {self.src} is a file: an im2rec .lst or Caffe list is read by the folder "
                              f"dataset (gpufeed convert folder {self.src} --root IMAGE_DIR ...); "
                              f"{self.dataset} reads the folder or archive the dataset ships as")
        if self.list_file is not None and self.splits is not None and len(self.splits) != 1:
            raise ConfigError(f"a list file converts to one split, and --split names {len(self.splits)}: give one "
                              f"name (by default the list's own, {os.path.basename(self.src).rsplit('.', 1)[0]})")
        if self.root is not None and self.list_file is None:
            raise ConfigError("--root says where a list file's paths start; SRC is not a list file, so drop --root "
                              "(or give the list file as SRC with the folder dataset)")
        if self.root is not None and "://" not in self.root and not os.path.isdir(self.root):
            raise ConfigError(f"--root {self.root} is not a folder; give the folder the list file's paths start from")

    def _check_out_not_in_src(self) -> None:
        """A destination inside the source would be listed as input by the next run (or this one); and a
        destination is a folder."""
        if "://" not in self.out and os.path.exists(self.out) and not os.path.isdir(self.out):
            raise ConfigError(f"--out {self.out} is {kind_of(os.stat(self.out).st_mode)}; the destination is a folder: "
                              "give a new one, or the folder of an earlier gpufeed convert run")
        if "://" in self.src or "://" in self.out or not self.src_is_place:
            return
        if self.list_file is not None:
            return  # the inputs are the files the list names: the engine checks that none is inside --out
        src, out = os.path.realpath(self.source_root), os.path.realpath(self.out)
        if os.path.isdir(src) and (out == src or out.startswith(src.rstrip(os.sep) + os.sep)):
            raise ConfigError(f"--out {self.out} is inside the source {self.src}: its files would be read as "
                              "inputs by the next run; choose a destination outside the source")

    def _check_store_dtype(self) -> None:
        """The rules of normalised float storage that belong to a conversion (its statistics pre-pass);
        check_image_options has checked the rest."""
        image = self.image
        given = [n for n, v in (("--mean", image.mean), ("--std", image.std)) if v is not None]
        if image.store_dtype == "uint8":
            if given:
                raise ConfigError(f"{' and '.join(given)} normalise stored pixels, which needs --store-dtype "
                                  "float16 or float32; drop them (--normalize alone only computes statistics)")
            return
        if len(given) == 1:
            raise ConfigError(f"{given[0]} needs its partner: give both --mean R,G,B and --std R,G,B")
        if not given and not self.normalize:
            raise ConfigError(f"--store-dtype {image.store_dtype} stores (pixel - mean) / std: give --mean R,G,B "
                              "and --std R,G,B (0-255 scale), or --normalize to compute them from the train split")

    @property
    def statistics_prepass(self) -> bool:
        """Normalised float storage without a given mean/std: the train split's statistics are computed
        first (an exact pass of their own), then used to normalise every split."""
        return self.image.store_dtype != "uint8" and self.image.mean is None

    @property
    def effective_shuffle(self) -> bool:
        """``--shuffle`` as applied: by default images are shuffled; Penn Treebank windows (synthetic ones too)
        keep their order, since language models read the token stream in order (truncated backpropagation
        through time)."""
        return not self.text if self.shuffle is None else self.shuffle

    @property
    def effective_encode(self) -> str:
        """``--encode`` as applied: by default the original bytes when nothing changes the pixels (im2rec
        ``--pass-through``), JPEG when they are resized or cropped, PNG for CIFAR (lossless; see
        :meth:`encode_for` for the formats that store it otherwise)."""
        image = self.image
        if image.encode is not None:
            return image.encode
        if image.store_dtype != "uint8":
            return "raw"
        if self.cifar:
            return "png"
        changed = any(v is not None for v in (image.resize, image.size, image.max_size))
        return "jpeg" if changed or image.center_crop or image.gray else "pass"

    def encode_for(self, fmt: str) -> str:
        """The encoding format ``fmt`` stores. Without ``--encode``, CIFAR is stored as each ecosystem
        ships it, so its own readers take it unchanged: raw pixel Datums in LMDB (Caffe's
        ``convert_cifar_data``), PNG in RecordIO (what ``ImageRecordIter`` decodes) and in TFRecord (as
        TFDS stores CIFAR). Every other case: :attr:`effective_encode` for all formats."""
        if self.image.encode is None and self.image.store_dtype == "uint8" and self.cifar:
            from gpufeed.formats import format_class

            return format_class(fmt).cifar_encode
        return self.effective_encode

    @property
    def default_shard_samples(self) -> int:
        """Samples per shard where no shard option is given: :data:`ASSEMBLED_SAMPLES_PER_SHARD` where every
        output is one per split appended shard after shard (its bytes the same whatever the shards: a single
        ``.rec``), else :data:`SAMPLES_PER_SHARD`."""
        return ASSEMBLED_SAMPLES_PER_SHARD if self._assembled_only() else SAMPLES_PER_SHARD

    @property
    def tapers(self) -> bool:
        """Whether a split's last shards are cut finer (:func:`gpufeed.convert.plan.shard_bounds`): where no
        shard option is given and no shard is a file anyone sees, as for :attr:`default_shard_samples`."""
        return (self.shards is None and self.shard_size is None and self.shard_bytes is None
                and self._assembled_only())

    def _assembled_only(self) -> bool:
        """Every output one per split, appended shard after shard: its bytes the same whatever the shards."""
        from gpufeed.formats.base import PER_SPLIT

        return all(f.layout == PER_SPLIT and not f.commits_per_shard for f in self.output_formats())

    def output_formats(self) -> list:
        """The formats to write, each configured as these options ask: TFRecord's label convention,
        RecordIO as one ``.rec`` per split or (``--shards``) one per shard."""
        return configured_formats(self.formats, self.shards, self.label_offset)

    def image_options(self) -> ImageOptions:
        """The image options a worker applies: ``image`` with its encoding chosen."""
        return dataclasses.replace(self.image, encode=self.effective_encode)

    def source_options(self) -> dict:
        if self.dataset == "ptb":
            return {"seq_len": self.seq_len, "ptb_mode": self.ptb_mode, "allow_incomplete": self.allow_incomplete}
        if self.dataset in ("cifar10", "cifar100", "imagenet"):
            return {"allow_incomplete": self.allow_incomplete}
        if self.list_file is not None:
            return {"list_file": os.path.abspath(self.list_file), "split": self.splits[0] if self.splits else None}
        return {}

    def output_key(self) -> dict:
        """The options that determine the output bytes, as JSON-ready values (journal and manifest). The
        source is named canonically, so a resume or a rerun that spells it otherwise (relative or absolute,
        through a symlink, a trailing slash) is the same run; the destination is not part of it at all: it is
        where the journal and manifest being compared are."""
        d = self.to_json()
        for k in (*_RUNTIME_ONLY, "out"):
            d.pop(k)
        d = canonical_places(d)
        encodes = {f: self.encode_for(f) for f in self.formats}
        d["encode"] = next(iter(encodes.values())) if len(set(encodes.values())) == 1 else encodes
        d["shuffle"] = self.effective_shuffle
        return d

    def to_json(self) -> dict:
        """Every option by name, the image options among the others (as journals and manifests record them)."""
        d = {**self.image.fields(), **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                        if f.name != "image"}}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}



def configured_formats(names, shards: int | None, label_offset: int = 0) -> list:
    """The formats ``names``, each configured as a conversion with these options writes it."""
    from gpufeed.formats import format_class

    return [format_class(name).for_conversion(shards, label_offset) for name in names]


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, what: str) -> int:
    """``"256MB"`` -> 256000000, ``"1GiB"`` -> 1073741824 (SI and binary units, case-insensitive)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m[2].lower() if m else None
    if not m or unit not in _BYTE_UNITS:
        raise ConfigError(f"{what} {text!r} is not a size; write it like 256MB or 1GiB")
    return int(float(m[1]) * _BYTE_UNITS[unit])


def parse_list(text: str, what: str) -> tuple[str, ...]:
    items = tuple(t.strip() for t in text.split(",") if t.strip())
    if not items:
        raise ConfigError(f"{what} {text!r} names nothing; give a comma-separated list")
    return items
