"""Penn Treebank (Mikolov's ``simple-examples``): ``ptb.{train,valid,test}.txt``, plain or in the ``.tgz``.

Token ids follow TensorFlow's PTB reader: ``<eos>`` ends every line, the vocabulary is built from train only
and sorted by (-count, word). Items are language-model windows of ``seq_len + 1`` ids taken every ``seq_len``
tokens (inputs ``ids[:-1]``, targets ``ids[1:]``), or whole sentences with their ``<eos>``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from gpufeed.errors import ConfigError, InputError, LabelError, SourceNotFound, UnsafeArchiveError
from gpufeed.pipelines.archive import ArchiveLimits, stream_tar
from gpufeed.pipelines.base import InlineRef, Item, Skipped
from gpufeed.pipelines.sources import BaseSource, Root, Vocabulary

SPLITS = ("train", "valid", "test")
FILES = {s: f"ptb.{s}.txt" for s in SPLITS}
ARCHIVE = "simple-examples.tgz"
ARCHIVE_DIR = "simple-examples/data"
EOS = "<eos>"
UNK = "<unk>"
MODES = ("window", "sentence")
#: The most text read of one split's file: six times Penn Treebank's training text (5.1 MB), so a small
#: archive that inflates to hundreds of megabytes (or a wrong file) is refused before it is held in memory.
MAX_TEXT_BYTES = 32 << 20


def _too_large(where: str) -> InputError:
    return InputError(where, f"holds more than {MAX_TEXT_BYTES >> 20} MiB of text, the most gpufeed reads of one Penn "
                      "Treebank file (its training text is 5.1 MB), so it was not read",
                      f"point SRC at Mikolov's simple-examples data (ptb.train.txt and the others, or {ARCHIVE})")


def tokenize(text: str) -> list[list[str]]:
    """Lines of tokens, ``<eos>`` appended to each (a final newline ends the last line, not a new one)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.split() + [EOS] for line in lines]


def build_vocab(sentences: list[list[str]]) -> tuple[list[str], list[int]]:
    counts = Counter(tok for s in sentences for tok in s)
    words = sorted(counts, key=lambda w: (-counts[w], w))
    return words, [counts[w] for w in words]


class PtbSource(BaseSource):
    name = "ptb"
    modality = "text"

    def __init__(self, root: Root, on_error: str = "fail", seq_len: int = 35, ptb_mode: str = "window",
                 limits: ArchiveLimits = ArchiveLimits(), allow_incomplete: bool = False, **options):
        if options:
            raise ConfigError(f"unknown ptb source options: {', '.join(sorted(options))}")
        if ptb_mode not in MODES:
            raise ConfigError(f"ptb_mode must be one of {MODES}, not {ptb_mode!r}")
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ConfigError(f"seq_len must be a positive integer, not {seq_len!r}")
        super().__init__(root, on_error)
        self.seq_len, self.mode, self.limits = seq_len, ptb_mode, limits
        self.allow_incomplete = allow_incomplete
        self._texts: dict[str, tuple[str, str]] | None = None
        self._vocab: Vocabulary | None = None
        path = root.path
        self.archive = self.folder = None
        if root.isfile(path) and path.rstrip("/").rsplit("/", 1)[-1] in FILES.values():
            folder = path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else "."
            raise ConfigError(f"{root.url(path)} is one of Penn Treebank's files; point SRC at the folder that holds "
                              f"{', '.join(FILES.values())} ({folder}), or at {ARCHIVE}")
        if root.isfile(path):
            self.archive = path
        elif root.isdir(path):
            for folder in (path, root.join(path, "data"), root.join(path, ARCHIVE_DIR)):
                if root.isfile(root.join(folder, FILES["train"])):
                    self.folder = folder
                    break
            else:
                if root.isfile(root.join(path, ARCHIVE)):
                    self.archive = root.join(path, ARCHIVE)
        if self.folder is None and self.archive is None:
            raise SourceNotFound(root, f"Penn Treebank ({FILES['train']} and its valid/test files, or {ARCHIVE})",
                                 "point SRC at the folder that holds them, or at the archive")

    def _load(self) -> dict[str, tuple[str, str]]:
        """``{split: (text, where)}``."""
        if self._texts is None:
            raw: dict[str, tuple[bytes, str]] = {}
            if self.archive:
                url = self.root.url(self.archive)
                by_name = {f"{ARCHIVE_DIR}/{f}": s for s, f in FILES.items()}
                limits = dataclasses.replace(self.limits, max_read_size=min(self.limits.max_read_size, MAX_TEXT_BYTES))
                try:
                    for name, data in stream_tar(url, lambda n: n in by_name, limits=limits, on_problem=self.problem):
                        raw[by_name[name]] = (data, f"{url}::{name}")
                except UnsafeArchiveError as e:
                    if "read into memory at most" not in e.reason:
                        raise
                    raise _too_large(e.path) from None
            else:
                for split, fname in FILES.items():
                    path = self.root.join(self.folder, fname)
                    if self.root.isfile(path):
                        data = self.root.read(path, limit=MAX_TEXT_BYTES)
                        if len(data) > MAX_TEXT_BYTES:
                            raise _too_large(self.root.url(path))
                        raw[split] = (data, self.root.url(path))
            if "train" not in raw:
                raise SourceNotFound(self.root, f"{FILES['train']}{' in ' + ARCHIVE_DIR if self.archive else ''}",
                                     "the vocabulary is built from the training text")
            missing = [FILES[s] for s in FILES if s not in raw]
            if missing:
                where = self.root.url(self.archive or self.folder)
                what = f"{', '.join(missing)} (Penn Treebank ships train, valid and test)"
                if not self.allow_incomplete:
                    raise SourceNotFound(where, what, "restore the missing file, or add --allow-incomplete to "
                                         "convert only the splits that are here")
                self._skipped.append(Skipped(where, f"missing {what}; converted without it (--allow-incomplete)"))
            texts = {}
            for split, (data, where) in raw.items():
                try:
                    texts[split] = (data.decode("utf-8"), where)
                except UnicodeDecodeError as e:
                    raise InputError(where, f"is not UTF-8 text ({e})", "use the original PTB files") from e
            self._texts = texts
        return self._texts

    def splits(self) -> list[str]:
        return [s for s in SPLITS if s in self._load()]

    def classes(self) -> Vocabulary:
        if self._vocab is None:
            words, counts = build_vocab(tokenize(self._load()["train"][0]))
            self._vocab = Vocabulary(names=words, counts=counts)
        return self._vocab

    def _list(self, split: str) -> list[Item]:
        text, where = self._load()[split]
        vocab = self.classes().names
        ids_of = {w: i for i, w in enumerate(vocab)}
        unk = ids_of.get(UNK)
        sentences = []
        for n, sent in enumerate(tokenize(text), 1):
            ids = []
            for tok in sent:
                i = ids_of.get(tok, unk)
                if i is None:
                    self.problem(LabelError(f"{where}:{n}", f"has the word {tok!r}, which is not in the training "
                                            f"vocabulary and there is no {UNK} to map it to",
                                            f"replace rare words with {UNK} as PTB does"))
                    ids = None
                    break
                ids.append(i)
            if ids is not None:
                sentences.append((n, np.asarray(ids, np.int32)))
        width = max(6, len(str(len(sentences))))
        if self.mode == "sentence":
            return [Item(f"{split}/{i:0{width}d}", 0, InlineRef(ids), {"source": f"{where}:{line}", "tokens": len(ids)})
                    for i, (line, ids) in enumerate(sentences)]
        stream = np.concatenate([ids for _, ids in sentences]) if sentences else np.zeros(0, np.int32)
        L = self.seq_len
        n = max(0, (len(stream) - 1) // L)
        width = max(6, len(str(n)))
        tail = len(stream) - (n * L + 1) if n else len(stream)
        if tail > 0:
            # Like TensorFlow's reader, a window needs seq_len + 1 ids; the remainder is reported, not hidden.
            self._skipped.append(Skipped(where, f"the last {tail} of {len(stream)} tokens of {split} do not fill a "
                                                f"window of {L} + 1 ids"))
        return [Item(f"{split}/{i:0{width}d}", 0, InlineRef(stream[i * L:i * L + L + 1].copy()),
                     {"source": f"{where}:tokens[{i * L}:{i * L + L + 1}]", "tokens": L + 1})
                for i in range(n)]
