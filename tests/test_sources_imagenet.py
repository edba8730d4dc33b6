"""ImageNet and image-folder sources over real files, real tars and fsspec memory://."""

from __future__ import annotations

import gc
import io
import os
import tarfile

import numpy as np
import pytest
import scipy.io
from PIL import Image

from gpufeed.errors import ConfigError, LabelError, SourceNotFound
from gpufeed.pipelines import open_source
from gpufeed.pipelines.base import FileRef, TarMemberRef, all_local_files, read_item
from gpufeed.pipelines.sources import read_ref, write_class_list
from gpufeed.pipelines.synth import synth_imagenet


def jpeg(seed: int, size=(24, 32)) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


def write(path, data: bytes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def meta_mat(path, leaves: dict[str, int], parents=()):
    """A devkit meta.mat: ``leaves`` maps wnid -> ILSVRC2012_ID; ``parents`` are (id, wnid, children ids)."""
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images"]
    rows = [(sid, w, f"words of {w}", "gloss", 0, np.zeros((1, 0)), 0, 10) for w, sid in leaves.items()]
    rows += [(sid, w, "group", "gloss", len(ch), np.array([ch]), 1, 0) for sid, w, ch in parents]
    arr = np.empty((len(rows), 1), dtype=[(f, object) for f in fields])
    for i, r in enumerate(rows):
        arr[i, 0] = tuple(np.array([[v]]) if isinstance(v, int) else (v if isinstance(v, np.ndarray) else np.array([v]))
                          for v in r)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    scipy.io.savemat(path, {"synsets": arr})


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    out = tmp_path_factory.mktemp("inet")
    synth_imagenet(str(out), classes=3, per_class=4, val_per_class=2, seed=7, layout="both")
    return str(out)


def snapshot(source, split):
    return [(it.key, it.label, it.meta.get("synset"), read_item(it)) for it in source.items(split)]


def test_tree_and_archives_hold_the_same_items(both):
    tree = open_source("imagenet", both, layout="tree")
    arch = open_source("imagenet", both, layout="archives")
    assert tree.splits() == arch.splits() == ["train", "val"]
    assert tree.classes() == arch.classes()
    for split in ("train", "val"):
        assert snapshot(tree, split) == snapshot(arch, split)
    assert all(isinstance(it.ref, FileRef) for it in tree.items("train"))
    refs = [it.ref for it in arch.items("train")]
    assert all(isinstance(r, TarMemberRef) for r in refs)
    # Offsets are absolute in the outer file: a plain seek into ILSVRC2012_img_train.tar finds the JPEG.
    last = arch.items("train")[-1]
    with open(last.ref.url, "rb") as f:
        f.seek(last.ref.offset)
        assert f.read(last.ref.size) == open(os.path.join(both, "train", last.key), "rb").read()
    keys = [it.key for it in arch.items("train")]
    assert keys == sorted(keys) and all(k.count("/") == 1 and k.startswith("n") for k in keys)
    assert [it.key for it in arch.items("val")][0] == "ILSVRC2012_val_00000001.JPEG"
    assert tree.classes().texts and tree.items("train")[0].meta["text"] == tree.classes().texts[0]


def test_archive_only_folder_uses_devkit_tar_gz(both, tmp_path):
    for name in ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar", "ILSVRC2012_devkit_t12.tar.gz"):
        os.link(os.path.join(both, name), tmp_path / name)
    src = open_source("imagenet", str(tmp_path))
    assert snapshot(src, "val") == snapshot(open_source("imagenet", both), "val")
    only_train = open_source("imagenet", str(tmp_path / "ILSVRC2012_img_train.tar"))
    assert only_train.splits() == ["train"]


def test_devkit_ids_are_mapped_to_sorted_wnid_index(tmp_path):
    wnids = ["n01440764", "n01443537", "n01484850", "n01491361"]
    # Devkit IDs in a different order than the wnids sort, and a parent synset that is not a class.
    ids = {"n01440764": 3, "n01443537": 1, "n01484850": 4, "n01491361": 2}
    meta_mat(str(tmp_path / "ILSVRC2012_devkit_t12/data/meta.mat"), ids, parents=[(5, "n00001740", [1, 2, 3, 4])])
    val_classes = ["n01491361", "n01440764", "n01484850", "n01443537", "n01440764"]
    (tmp_path / "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt").write_text(
        "".join(f"{ids[w]}\n" for w in val_classes))
    for j in range(1, 6):
        write(str(tmp_path / f"val/ILSVRC2012_val_{j:08d}.JPEG"), jpeg(j))
    src = open_source("imagenet", str(tmp_path))
    assert list(src.classes().names) == wnids
    assert src.classes().texts[0] == "words of n01440764"
    assert [it.label for it in src.items("val")] == [wnids.index(w) for w in val_classes]
    assert [it.meta["synset"] for it in src.items("val")] == val_classes


def test_loc_solution_and_plain_label_files(tmp_path):
    (tmp_path / "LOC_synset_mapping.txt").write_text("n02\tb thing\nn01 a thing\n".replace("\t", " "))
    (tmp_path / "LOC_val_solution.csv").write_text(
        "ImageId,PredictionString\nILSVRC2012_val_00000002,n01 1 2 3 4\n"
        "ILSVRC2012_val_00000001,n02 1 2 3 4 n01 0 0 1 1\n")
    for j in (1, 2):
        write(str(tmp_path / f"val/ILSVRC2012_val_{j:08d}.JPEG"), jpeg(j))
    src = open_source("imagenet", str(tmp_path))
    assert src.classes().texts == ["a thing", "b thing"]
    assert [(it.key, it.label) for it in src.items("val")] == [
        ("ILSVRC2012_val_00000001.JPEG", 1), ("ILSVRC2012_val_00000002.JPEG", 0)]
    os.remove(tmp_path / "LOC_val_solution.csv")
    (tmp_path / "val_labels.txt").write_text("ILSVRC2012_val_00000001.JPEG 0\nILSVRC2012_val_00000002.JPEG n02\n")
    assert [it.label for it in open_source("imagenet", str(tmp_path)).items("val")] == [0, 1]


def test_listing_problems_fail_or_are_skipped_by_policy(tmp_path):
    meta_mat(str(tmp_path / "meta.mat"), {"n01": 1, "n02": 2})
    (tmp_path / "ILSVRC2012_validation_ground_truth.txt").write_text("1\n2\n")
    write(str(tmp_path / "train/n01/n01_1.JPEG"), jpeg(1))
    write(str(tmp_path / "train/n09/n09_1.JPEG"), jpeg(2))  # a synset the devkit does not know
    write(str(tmp_path / "train/n02/notes.txt"), b"not an image")
    write(str(tmp_path / "val/ILSVRC2012_val_00000001.JPEG"), jpeg(3))
    write(str(tmp_path / "val/ILSVRC2012_val_00000003.JPEG"), jpeg(4))  # no ground-truth line
    bad_name = os.path.join(os.fsencode(tmp_path), b"train", b"n02", b"caf\xe9.JPEG")  # Latin-1, not UTF-8
    with open(bad_name, "wb") as f:
        f.write(jpeg(5))

    with pytest.raises(LabelError, match=r"caf\\xe9.JPEG: has a file name that is not UTF-8"):
        open_source("imagenet", str(tmp_path)).items("train")
    with pytest.raises(LabelError, match="has no label"):
        open_source("imagenet", str(tmp_path)).items("val")

    src = open_source("imagenet", str(tmp_path), on_error="skip")
    assert [it.key for it in src.items("train")] == ["n01/n01_1.JPEG"]
    assert [it.key for it in src.items("val")] == ["ILSVRC2012_val_00000001.JPEG"]
    reasons = " | ".join(s.reason for s in src.skipped())
    assert len(src.skipped()) == 4
    for text in ("unknown class 'n09'", "not an image file", "not UTF-8", "has no label"):
        assert text in reasons


def test_duplicate_member_in_train_tar_is_a_label_error(tmp_path):
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w") as t:
        for seed in (1, 2):
            data = jpeg(seed)
            info = tarfile.TarInfo("n01_1.JPEG")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    with tarfile.open(tmp_path / "ILSVRC2012_img_train.tar", "w") as outer:
        info = tarfile.TarInfo("n01.tar")
        info.size = len(inner.getvalue())
        outer.addfile(info, io.BytesIO(inner.getvalue()))
    with pytest.raises(LabelError, match="keys must be unique"):
        open_source("imagenet", str(tmp_path)).items("train")
    assert gc.isenabled()  # the listing holds the garbage collector off while it runs, and only then
    src = open_source("imagenet", str(tmp_path), on_error="skip")
    assert len(src.items("train")) == 1 and len(src.skipped()) == 1
    gc.disable()
    try:  # a caller's own setting is left as it was
        open_source("imagenet", str(tmp_path), on_error="skip").items("train")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_nothing_recognisable_names_what_was_expected(tmp_path):
    with pytest.raises(SourceNotFound, match="ILSVRC2012_img_train.tar"):
        open_source("imagenet", str(tmp_path))
    with pytest.raises(ConfigError, match="unknown dataset"):
        open_source("mnist", str(tmp_path))
    write(str(tmp_path / "val/ILSVRC2012_val_00000001.JPEG"), jpeg(1))
    with pytest.raises(SourceNotFound, match="LOC_val_solution.csv"):
        open_source("imagenet", str(tmp_path)).items("val")


def test_memory_filesystem(both):
    import fsspec

    fs = fsspec.filesystem("memory")
    for dirpath, _, files in os.walk(both):
        for name in files:
            local = os.path.join(dirpath, name)
            fs.pipe("/inet/" + os.path.relpath(local, both), open(local, "rb").read())
    for layout in ("tree", "archives"):
        mem = open_source("imagenet", "memory://inet", layout=layout)
        assert snapshot(mem, "val") == snapshot(open_source("imagenet", both), "val")
        assert mem.items("train")[0].ref.url.startswith("memory://")
        assert not all_local_files(mem.items("train"))  # a folder's URL prefix stands for its files
    written = write_class_list(mem.classes(), "memory://out/run1")
    text = fs.cat("/out/run1/classes.txt").decode()
    assert written == ["memory://out/run1/classes.txt"]
    assert text.splitlines()[0] == f"0\t{mem.classes().names[0]}\t{mem.classes().texts[0]}"


def test_folder_tree_splits_and_list_files(tmp_path):
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            write(str(tmp_path / split / cls / "sub" / f"{cls}1.png"), jpeg(1))
    os.symlink("..", tmp_path / "train" / "cat" / "sub" / "loop")  # a folder loop must not hang the walk
    src = open_source("folder", str(tmp_path))
    assert src.splits() == ["train", "val"] and src.classes().names == ["cat", "dog"]
    assert [it.key for it in src.items("train")] == ["cat/sub/cat1.png", "dog/sub/dog1.png"]
    assert [(it.key, it.label) for it in src.items("val")] == [("cat/sub/cat1.png", 0), ("dog/sub/dog1.png", 1)]

    (tmp_path / "train.lst").write_text("0\t1.000000\ttrain/dog/sub/dog1.png\n1\t0.000000\ttrain/cat/sub/cat1.png\n")
    lst = open_source("folder", str(tmp_path), list_file="train.lst")
    assert lst.splits() == ["train"]
    # The list's order and its index column (the records' ids), not sorted or renumbered.
    assert [(it.key, it.label, it.meta["list_index"]) for it in lst.items("train")] == [
        ("train/dog/sub/dog1.png", 1, 0), ("train/cat/sub/cat1.png", 0, 1)]
    assert read_ref(lst.items("train")[0].ref) == jpeg(1)
    # The split is the list's stem, as im2rec names the .rec after the .lst, or what --split says.
    (tmp_path / "pets_val.lst").write_text("7\t0\tval/cat/sub/cat1.png\n3\t1\tval/dog/sub/dog1.png\n")
    assert open_source("folder", str(tmp_path), list_file="pets_val.lst").splits() == ["pets_val"]
    assert open_source("folder", str(tmp_path), list_file="pets_val.lst", split="val").splits() == ["val"]
    with pytest.raises(ConfigError, match="split name 'a b'"):
        open_source("folder", str(tmp_path), list_file="pets_val.lst", split="a b")
    (tmp_path / "dup.lst").write_text("7\t0\tval/cat/sub/cat1.png\n7\t1\tval/dog/sub/dog1.png\n")
    with pytest.raises(LabelError, match="dup.lst:2.*repeats the index 7 of line 1"):
        open_source("folder", str(tmp_path), list_file="dup.lst").items("dup")
    (tmp_path / "val.txt").write_text("val/cat/sub/cat1.png 3\nval/dog/sub/dog1.png x\n")
    with pytest.raises(LabelError, match="val.txt:2"):
        open_source("folder", str(tmp_path), list_file="val.txt").items("val")
    caffe = open_source("folder", str(tmp_path), list_file="val.txt", on_error="skip")
    assert [(it.key, it.label) for it in caffe.items("val")] == [("val/cat/sub/cat1.png", 3)]
    assert caffe.classes().names == ["0", "1", "2", "3"]
    write_class_list(src.classes(), str(tmp_path / "out"))
    assert (tmp_path / "out/classes.txt").read_text() == "0\tcat\n1\tdog\n"


def test_numeric_val_labels_without_a_class_list(tmp_path):
    for j in (1, 2, 3):
        write(str(tmp_path / f"val/ILSVRC2012_val_{j:08d}.JPEG"), jpeg(j))
    (tmp_path / "val_labels.txt").write_text("ILSVRC2012_val_00000001 10\nILSVRC2012_val_00000002 2\n"
                                             "ILSVRC2012_val_00000003 0\n")
    src = open_source("imagenet", str(tmp_path))
    assert len(src.classes().names) == 11
    assert [it.label for it in src.items("val")] == [10, 2, 0]


def test_a_train_split_missing_classes_the_devkit_lists_is_an_error_unless_allowed(tmp_path):
    meta_mat(str(tmp_path / "meta.mat"), {"n01": 1, "n02": 2, "n03": 3})
    write(str(tmp_path / "train/n01/n01_1.JPEG"), jpeg(1))
    write(str(tmp_path / "train/n03/n03_1.JPEG"), jpeg(2))
    with pytest.raises(SourceNotFound, match=r"train: training images of 1 of the 3 classes the devkit lists "
                                             r"\(n02\) not found; .*--allow-incomplete"):
        open_source("imagenet", str(tmp_path)).items("train")
    src = open_source("imagenet", str(tmp_path), allow_incomplete=True)
    assert [it.label for it in src.items("train")] == [0, 2]  # the devkit's numbering is kept
    assert "no training images of 1 of the 3 classes" in src.skipped()[0].reason


def test_all_local_files_tells_local_files_from_urls_members_and_inline_data():
    """The driver digests local files in the workers only where every input is one: told per item in C where no
    URL is present, and each URL then checked (a file:// URL is a local file)."""
    from gpufeed.pipelines.base import InlineRef, Item

    def item(ref):
        return Item("k", 0, ref)

    local = [item(FileRef("/data/a.JPEG")), item(FileRef("rel/b.JPEG"))]
    assert all_local_files(local) and all_local_files([])
    assert all_local_files(local + [item(FileRef("file:///data/c.JPEG"))])
    assert not all_local_files(local + [item(FileRef("s3://bucket/c.JPEG"))])
    assert not all_local_files(local + [item(TarMemberRef("/data/t.tar", 512, 10, "m.JPEG"))])
    assert not all_local_files(local + [item(InlineRef(b"x"))])


def test_a_tree_listing_keeps_folders_as_names_and_makes_the_same_items(tmp_path):
    """A class folder of image names is kept as its names (ListedItems); each Item is made when asked for, by
    position (numpy's integers too, negative ones, slices) or in turn, and is what listing file by file makes."""
    from gpufeed.pipelines.base import ListedItems, keys_of

    for cls, names in {"n01": ["a.JPEG", "b.jpg"], "n02": ["c.JPEG", "d ü.JPEG", "notes.txt"], "n03": []}.items():
        os.makedirs(tmp_path / "train" / cls, exist_ok=True)
        for name in names:
            write(str(tmp_path / "train" / cls / name), jpeg(len(name)))
    src = open_source("imagenet", str(tmp_path), on_error="skip")
    items = src.items("train")
    assert isinstance(items, ListedItems)
    keys = ["n01/a.JPEG", "n01/b.jpg", "n02/c.JPEG", "n02/d ü.JPEG"]  # notes.txt skipped, and listed
    assert keys_of(items) == keys and len(items) == 4
    made = [(it.key, it.label, it.ref, dict(it.meta)) for it in items]
    url = str(tmp_path / "train") + os.sep
    assert [(k, lab, ref) for k, lab, ref, _ in made] == [(k, int(k[2]) - 1, FileRef(url + k)) for k in keys]
    assert [(it.key, it.ref) for it in (items[np.int64(1)], items[-1], items[0])] == [
        (keys[1], FileRef(url + keys[1])), (keys[3], FileRef(url + keys[3])), (keys[0], FileRef(url + keys[0]))]
    assert [it.key for it in items[1:3]] == keys[1:3] and [it.key for it in items[::-2]] == keys[::-2]
    with pytest.raises(IndexError):
        items[4]
    assert [s.origin for s in src.skipped()] == [url + "n02/notes.txt"]
    assert all_local_files(items)
    assert [read_item(items[i]) for i in range(4)] == [jpeg(len(k.split("/")[1])) for k in keys]
    # A shard's items handed out (pickled to a worker) as a batch: folder-file pairs and the loose Items.
    import pickle

    from gpufeed.pipelines.base import ItemBatch, take_items

    batch = pickle.loads(pickle.dumps(take_items(items, np.array([3, 0, 2]))))
    assert isinstance(batch, ItemBatch) and len(batch) == 3
    assert [(it.key, it.label, it.ref) for it in batch] == [(it.key, it.label, it.ref) for it in
                                                            (items[3], items[0], items[2])]
    assert [it.key for it in batch[1:]] == [keys[0], keys[2]] and batch[0].key == keys[3]
    assert take_items(list(items), [1])[0].key == keys[1]
    with pytest.raises(IndexError):
        take_items(items, [0, 4])


def test_a_listing_walked_out_of_key_order_is_sorted_by_key(tmp_path):
    """Folders walked in name order give keys out of order where one class name is another's prefix
    ("a-b/x" sorts before "a/x"): the split is still sorted by key."""
    for cls in ("a", "a-b"):
        write(str(tmp_path / "train" / cls / "x.png"), jpeg(1))
    src = open_source("folder", str(tmp_path))
    assert [(it.key, it.label) for it in src.items("train")] == [("a-b/x.png", 1), ("a/x.png", 0)]
