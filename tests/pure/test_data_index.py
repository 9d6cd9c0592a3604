"""The index of a job's data files (``orchestrator/data/index.py``, ``jobspec/data_index.py``):
globs expanded in order, files described and kept in the run directory, a resumed run's files
checked; each bad input one line naming the field and the file. Threads here; Ray tasks in
tests/ray_jobs/test_file_data.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from jobspec.data_index import DataIndex
from jobspec.fields import ConfigError
from jobspec.recipe import DatasetSpec
from orchestrator.data.index import build_index, expand, index_path, run_indexes


def _tokens(directory: Path, counts: dict[str, int]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, count in counts.items():
        np.arange(count, dtype="<u2").tofile(directory / name)


def test_globs_expand_sorted_lists_in_order_and_directories_whole(tmp_path: Path, monkeypatch):
    _tokens(tmp_path / "d", {"b.bin": 8, "a.bin": 8, "c.txt": 8})
    _tokens(tmp_path / "d" / "sub", {"z.bin": 8})
    assert expand(str(tmp_path / "d" / "*.bin"), "dataset.files") == [str(tmp_path / "d" / n) for n in ("a.bin", "b.bin")]
    listed = [str(tmp_path / "d" / "b.bin"), str(tmp_path / "d" / "a.bin")]
    assert expand(listed, "dataset.files") == listed
    assert expand(str(tmp_path / "d" / "**" / "*.bin"), "dataset.files") == [
        str(tmp_path / "d" / n) for n in ("a.bin", "b.bin", "sub/z.bin")
    ]
    monkeypatch.chdir(tmp_path)  # a relative glob gives absolute paths: workers run elsewhere
    assert expand("d/a.*", "dataset.files") == [str(tmp_path / "d" / "a.bin")]
    whole = expand(str(tmp_path / "d"), "dataset.files")
    assert whole == sorted(whole) and len(whole) == 4 and str(tmp_path / "d" / "sub" / "z.bin") in whole


@pytest.mark.parametrize(
    "files, expected",
    [
        ("d/*.npy", "field 'dataset.files': {d}/*.npy matches no file"),
        ("d/missing.bin", "field 'dataset.files': {d}/missing.bin does not exist"),
        ("nowhere/*.bin", "field 'dataset.files': {nowhere}/*.bin matches no file"),
    ],
)
def test_a_glob_that_matches_nothing_or_a_missing_file_is_one_line_naming_it(tmp_path: Path, files, expected):
    _tokens(tmp_path / "d", {"a.bin": 8})
    with pytest.raises(ConfigError) as err:
        expand(str(tmp_path / files), "dataset.files")
    message = expected.format(d=tmp_path / "d", nowhere=tmp_path / "nowhere")
    assert str(err.value) == f"invalid job: {message}"


def test_the_index_counts_samples_and_locates_them(tmp_path: Path):
    _tokens(tmp_path, {"a.bin": 100, "b.bin": 40, "c.bin": 64})
    index = build_index(DatasetSpec(files=str(tmp_path / "*.bin"), format="tokens", seq_len=16), "dataset", 30)
    assert [f.samples for f in index.files] == [6, 2, 4] and index.samples == 12
    assert index.locate(0)[1] == 0 and index.locate(6) == (index.files[1], 0) and index.locate(11) == (index.files[2], 3)
    assert DataIndex.from_json(json.loads(json.dumps(index.to_json()))) == index
    with pytest.raises(IndexError):
        index.locate(12)


def test_seq_len_larger_than_a_file_is_refused_naming_the_file(tmp_path: Path):
    _tokens(tmp_path, {"a.bin": 100, "b.bin": 10})
    with pytest.raises(ConfigError, match=r"'dataset.files': .*b.bin \(20 bytes\) holds no sample of seq_len 16$"):
        build_index(DatasetSpec(files=str(tmp_path / "*.bin"), format="tokens", seq_len=16), "dataset", 30)


def test_a_bad_file_is_named_with_its_field(tmp_path: Path):
    (tmp_path / "a.npy").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match=r"field 'eval.files': .*a.npy: not a .npy file"):
        build_index(DatasetSpec(files=str(tmp_path / "a.npy"), format="npy"), "eval", 30)


def test_a_run_keeps_its_index_and_a_resumed_run_refuses_files_that_changed(tmp_path: Path):
    data, run_dir = tmp_path / "data", tmp_path / "run"
    _tokens(data, {"a.bin": 64, "b.bin": 64})
    sources = {"dataset": DatasetSpec(files=str(data / "*.bin"), format="tokens", seq_len=16), "eval": None}
    notes: list[str] = []
    first = run_indexes(sources, run_dir, False, 30, notes.append)
    assert notes == ["dataset: 8 samples in 2 tokens file(s)"] and list(first) == ["dataset"]
    assert DataIndex.from_json(json.loads(index_path(run_dir, "dataset").read_text())) == first["dataset"]
    assert run_indexes(sources, run_dir, True, 30) == first
    _tokens(data, {"c.bin": 64})  # a new file matching the glob: the resumed run keeps its own list
    assert run_indexes(sources, run_dir, True, 30) == first
    stat = (data / "b.bin").stat()
    os.utime(data / "b.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    with pytest.raises(ConfigError, match=r"'dataset.files': .*b.bin changed since the run indexed it \(modified"):
        run_indexes(sources, run_dir, True, 30)
    np.arange(80, dtype="<u2").tofile(data / "b.bin")
    with pytest.raises(ConfigError, match=r"b.bin changed since the run indexed it \(size 128 -> 160 bytes"):
        run_indexes(sources, run_dir, True, 30)
    (data / "b.bin").unlink()
    with pytest.raises(ConfigError, match=r"b.bin is gone since the run indexed it"):
        run_indexes(sources, run_dir, True, 30)


def test_a_uri_pyarrow_cannot_parse_is_refused_without_its_secret():
    with pytest.raises(ConfigError) as err:
        expand(["s3://key:secret@bu cket/x.bin"], "dataset.files")
    assert "Cannot parse URI" in str(err.value) and "secret" not in str(err.value)


def test_npy_files_of_other_row_shapes_are_refused_naming_one(tmp_path: Path):
    np.save(tmp_path / "a.npy", np.zeros((4, 8), dtype=np.int32))
    np.save(tmp_path / "b.npy", np.zeros((4, 6), dtype=np.int32))
    with pytest.raises(ConfigError, match=r"b.npy holds rows of 6 <i4 items, other files another shape"):
        build_index(DatasetSpec(files=str(tmp_path / "*.npy"), format="npy"), "dataset", 30)


def test_uris_split_into_their_filesystem_and_the_path_listings_give():
    """The part of a URI its filesystem's listings leave out (scheme, credentials, an HDFS
    namenode), the path they give, and the query, put back on each file found."""
    from orchestrator.data.index import _split

    assert _split("s3://k:s@bucket/t/*.bin?endpoint_override=h:1") == ("s3://k:s@", "bucket/t/*.bin", "?endpoint_override=h:1")
    assert _split("hdfs://namenode:8020/corpus/*.bin") == ("hdfs://namenode:8020", "/corpus/*.bin", "")
    assert _split("gs://bucket/x.npy") == ("gs://", "bucket/x.npy", "")
