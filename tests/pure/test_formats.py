"""Indexed files' formats (``workers/data/formats.py``) read back sample by sample through the
dataset of a file source (``workers/data/files.py``), on real files; and each bad file named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from jobspec.data_index import DataIndex
from jobspec.recipe import DatasetSpec
from workers.data.files import IndexedFiles, file_spec, open_source
from workers.data.formats import FORMATS, DataFileError, as_sample


def _indexed(source: DatasetSpec, uris: list[str]) -> IndexedFiles:
    """The dataset of ``uris`` described as the driver would (here, one by one)."""
    from orchestrator.data.index import describe

    return IndexedFiles(DataIndex(source.format, file_spec(source), tuple(describe(uris, source.format, file_spec(source)))))


def test_token_files_are_windows_of_seq_len_laid_end_to_end_without_a_tail(tmp_path: Path):
    for i, count in enumerate((100, 64, 31)):
        np.arange(1000 * i, 1000 * i + count, dtype="<u4").tofile(tmp_path / f"t{i}.bin")
    source = DatasetSpec(files=str(tmp_path / "t*.bin"), format="tokens", seq_len=16, dtype="uint32")
    data = _indexed(source, [str(tmp_path / f"t{i}.bin") for i in range(3)])
    assert len(data) == 6 + 4 + 1  # 100 // 16, 64 // 16, 31 // 16: a window never straddles two files
    assert torch.equal(data[0], torch.arange(0, 16)) and data[0].dtype == torch.int64
    assert torch.equal(data[6], torch.arange(1000, 1016)) and torch.equal(data[10], torch.arange(2000, 2016))
    with pytest.raises(IndexError):
        data[11]


def test_npy_rows_and_windows(tmp_path: Path):
    np.save(tmp_path / "rows.npy", np.arange(40, dtype=np.int16).reshape(8, 5))
    np.save(tmp_path / "flat.npy", np.linspace(0, 1, 30, dtype=np.float64))
    rows = _indexed(DatasetSpec(files="x", format="npy"), [str(tmp_path / "rows.npy")])
    assert len(rows) == 8 and torch.equal(rows[7], torch.arange(35, 40))
    flat = _indexed(DatasetSpec(files="x", format="npy", seq_len=7), [str(tmp_path / "flat.npy")])
    assert len(flat) == 4 and flat[1].dtype == torch.float32
    assert torch.allclose(flat[1], torch.from_numpy(np.linspace(0, 1, 30)[7:14]).float())


def test_parquet_rows_across_row_groups_and_jsonl_lines(tmp_path: Path):
    pq.write_table(pa.table({"ids": [[i, i + 1] for i in range(30)], "text": [f"s{i}" for i in range(30)]}),
                   tmp_path / "p.parquet", row_group_size=7)
    parquet = _indexed(DatasetSpec(files="x", format="parquet", column="ids"), [str(tmp_path / "p.parquet")])
    assert [parquet[i].tolist() for i in (0, 6, 7, 29)] == [[0, 1], [6, 7], [7, 8], [29, 30]]
    text = _indexed(DatasetSpec(files="x", format="parquet", column="text"), [str(tmp_path / "p.parquet")])
    assert text[13] == "s13"
    lines = [json.dumps({"id": i, "x": [i, 2 * i]}) for i in range(5)]
    (tmp_path / "j.jsonl").write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]))  # a blank line, no final newline
    jsonl = _indexed(DatasetSpec(files="x", format="jsonl", column="x"), [str(tmp_path / "j.jsonl")])
    assert [jsonl[i].tolist() for i in range(5)] == [[i, 2 * i] for i in range(5)]


def test_a_map_style_hugging_face_dataset_is_a_factory_source_as_it_is():
    """Its batched fetch (``__getitems__``) gives each sampled row, by index, as a dict."""
    from workers.data.batches import fetch_batch
    from workers.data.sampler import ShardSampler

    data = open_source(DatasetSpec(factory="tests.helpers.streams:make_hf_map_dataset"), None)
    indices = ShardSampler(len(data), 16, 4, seed=0).indices(3, [1, 2])
    batch = fetch_batch(data, indices, None)
    assert torch.equal(batch["tokens"][:, 0], torch.as_tensor(indices)) and batch["tokens"].shape == (8, 2)


def test_a_factory_source_builds_its_dataset_and_a_file_source_needs_its_index(tmp_path: Path):
    built = open_source(DatasetSpec(factory="ringleader_examples.digits:make_dataset", kwargs={"split": "test"}), None)
    assert len(built) > 0
    with pytest.raises(ValueError, match="without their index"):
        open_source(DatasetSpec(files="x", format="npy"), None)


@pytest.mark.parametrize(
    "format, content, spec, expected",
    [
        ("tokens", b"\x00\x01\x02", {"seq_len": 1}, "3 bytes is not a whole number of uint16 tokens"),
        ("npy", b"not numpy", {}, "not a .npy file"),
        ("parquet", b"not parquet", {"column": "x"}, "not a parquet file"),
    ],
)
def test_a_file_that_is_not_its_format_is_named(tmp_path: Path, format, content, spec, expected):
    bad = tmp_path / "bad"
    bad.write_bytes(content)
    full = {"dtype": "uint16", "seq_len": None, "column": None, **spec}
    with pytest.raises(DataFileError, match=expected) as err:
        FORMATS[format].describe(str(bad), len(content), full)
    assert str(bad) in str(err.value)


def test_a_truncated_npy_and_a_missing_column_are_named(tmp_path: Path):
    np.save(tmp_path / "a.npy", np.arange(100, dtype=np.int64).reshape(10, 10))
    cut = (tmp_path / "a.npy").read_bytes()[:-8]
    (tmp_path / "a.npy").write_bytes(cut)
    with pytest.raises(DataFileError, match="truncated"):
        FORMATS["npy"].describe(str(tmp_path / "a.npy"), len(cut), {"seq_len": None})
    pq.write_table(pa.table({"a": [1]}), tmp_path / "p.parquet")
    with pytest.raises(DataFileError, match=r"no column 'b' \(columns: a\)"):
        FORMATS["parquet"].describe(str(tmp_path / "p.parquet"), 0, {"column": "b"})


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"x": 1}\n{"x": oops}\n{"y": 2}\n', r"j.jsonl: the record at byte offset 9 does not decode \(JSONDecodeError"),
        ('{"x": 1}\n\n{"y": 2}', r"j.jsonl: the record at byte offset 10 does not decode \(KeyError\('x'\)\)"),
    ],
)
def test_a_record_that_does_not_decode_is_refused_by_the_index_naming_file_and_offset(tmp_path: Path, content, expected):
    (tmp_path / "j.jsonl").write_text(content)
    with pytest.raises(DataFileError, match=expected):
        _indexed(DatasetSpec(files="x", format="jsonl", column="x"), [str(tmp_path / "j.jsonl")])


def test_a_file_cut_short_after_indexing_is_named_when_read(tmp_path: Path):
    np.arange(64, dtype="<u2").tofile(tmp_path / "t.bin")
    data = _indexed(DatasetSpec(files="x", format="tokens", seq_len=16), [str(tmp_path / "t.bin")])
    (tmp_path / "t.bin").write_bytes((tmp_path / "t.bin").read_bytes()[:70])
    assert len(data[1]) == 16
    with pytest.raises(DataFileError, match=r"t.bin: 32 bytes at offset 96 asked, 0 there \(truncated\?\)"):
        data[3]


def test_samples_become_tensors_where_they_are_numbers():
    assert as_sample([1, 2]).dtype == torch.int64 and as_sample(2.5).dtype == torch.float32
    assert as_sample("text") == "text" and as_sample({"a": 1}) == {"a": 1} and as_sample(None) is None
