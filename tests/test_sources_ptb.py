"""Penn Treebank source: TensorFlow's ids, LM windows, sentences, the .tgz and memory://."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

from gpufeed.errors import ConfigError, LabelError, SourceNotFound
from gpufeed.pipelines import open_source
from gpufeed.pipelines.sources import write_class_list

TRAIN = " the cat sat \n the dog sat on the <unk> \n a cat \n"
VALID = " the bird sat \n"
TEST = " a dog \n"


@pytest.fixture
def ptb(tmp_path):
    for split, text in (("train", TRAIN), ("valid", VALID), ("test", TEST)):
        (tmp_path / f"ptb.{split}.txt").write_text(text)
    return tmp_path


def ids(words, vocab):
    return [vocab.index(w) for w in words.split()]


def test_vocabulary_is_train_only_sorted_by_count_then_word(ptb):
    src = open_source("ptb", str(ptb))
    vocab = list(src.classes().names)
    # <eos> and "the" 3 times (ties go by the word: "<" sorts before "t"), cat and sat twice, then the rest.
    assert vocab == ["<eos>", "the", "cat", "sat", "<unk>", "a", "dog", "on"]
    assert list(src.classes().counts) == [3, 3, 2, 2, 1, 1, 1, 1]
    write_class_list(src.classes(), str(ptb / "out"))
    assert (ptb / "out/vocab.txt").read_text().split("\n")[:3] == ["<eos>", "the", "cat"]


def test_windows_hold_seq_len_plus_one_ids_every_seq_len(ptb):
    src = open_source("ptb", str(ptb), seq_len=4)
    vocab = list(src.classes().names)
    stream = ids("the cat sat <eos> the dog sat on the <unk> <eos> a cat <eos>", vocab)
    items = src.items("train")
    assert [it.key for it in items] == ["train/000000", "train/000001", "train/000002"]
    for i, it in enumerate(items):
        assert it.ref.data.dtype == np.int32
        assert it.ref.data.tolist() == stream[i * 4:i * 4 + 5]
    # 14 tokens: windows cover 3*4+1 = 13, the last token is reported.
    assert "the last 1 of 14 tokens" in src.skipped()[0].reason
    assert src.splits() == ["train", "valid", "test"]


def test_sentences_and_unknown_words_become_unk(ptb):
    src = open_source("ptb", str(ptb), ptb_mode="sentence")
    vocab = list(src.classes().names)
    assert [it.ref.data.tolist() for it in src.items("train")][2] == ids("a cat <eos>", vocab)
    # "bird" is not in train: mapped to <unk>, as in the real valid/test files.
    assert src.items("valid")[0].ref.data.tolist() == ids("the <unk> sat <eos>", vocab)
    assert src.items("test")[0].key == "test/000000"


def test_word_outside_vocabulary_without_unk_is_a_label_error(tmp_path):
    (tmp_path / "ptb.train.txt").write_text("a b\n")
    (tmp_path / "ptb.valid.txt").write_text("a c\n")
    (tmp_path / "ptb.test.txt").write_text("a\n")
    with pytest.raises(LabelError, match=r"ptb.valid.txt:1: has the word 'c'"):
        open_source("ptb", str(tmp_path), ptb_mode="sentence").items("valid")
    assert open_source("ptb", str(tmp_path), ptb_mode="sentence", on_error="skip").items("valid") == []


def tgz_bytes(files):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, text in files:
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return out.getvalue()


def test_simple_examples_tgz_local_and_in_memory(ptb, tmp_path):
    files = [("./simple-examples/data/ptb.train.txt", TRAIN), ("./simple-examples/data/ptb.valid.txt", VALID),
             ("./simple-examples/data/ptb.test.txt", TEST), ("./simple-examples/models/readme", "x")]
    data = tgz_bytes(files)
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "simple-examples.tgz").write_bytes(data)
    import fsspec

    fsspec.filesystem("memory").pipe("/ptb/simple-examples.tgz", data)
    expected = [(it.key, it.ref.data.tolist()) for it in open_source("ptb", str(ptb), seq_len=2).items("valid")]
    assert len(expected) == 1
    for src in (str(tmp_path / "archive"), str(tmp_path / "archive" / "simple-examples.tgz"), "memory://ptb"):
        got = open_source("ptb", src, seq_len=2)
        assert [(it.key, it.ref.data.tolist()) for it in got.items("valid")] == expected
        assert "simple-examples.tgz::simple-examples/data/ptb.valid.txt" in got.items("valid")[0].meta["source"]


def test_bad_options_and_missing_files(tmp_path):
    with pytest.raises(SourceNotFound, match="simple-examples.tgz"):
        open_source("ptb", str(tmp_path))
    (tmp_path / "ptb.train.txt").write_text("a\n")
    with pytest.raises(ConfigError, match="ptb_mode"):
        open_source("ptb", str(tmp_path), ptb_mode="chars")
    with pytest.raises(ConfigError, match="seq_len"):
        open_source("ptb", str(tmp_path), seq_len=0)
    # Only the training text: the dataset ships three files, so that is an error unless allowed.
    with pytest.raises(SourceNotFound, match=r"ptb.valid.txt, ptb.test.txt \(Penn Treebank ships .*--allow-incomplete"):
        open_source("ptb", str(tmp_path)).splits()
    partial = open_source("ptb", str(tmp_path), allow_incomplete=True)
    assert partial.splits() == ["train"] and "missing ptb.valid.txt" in partial.skipped()[0].reason
    with pytest.raises(ConfigError, match="no split 'test'"):
        partial.items("test")
