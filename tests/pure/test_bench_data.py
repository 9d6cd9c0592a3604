"""``ringleader bench data``'s reader and resume figures on a small directory of token files (its
job figure runs a real job: tests/ray_jobs/test_file_data.py covers such jobs)."""

from __future__ import annotations

import numpy as np

from benchmarks.data import RESUME_SAMPLES, format_figures, reader_figures, resume_figures, token_index, write_token_dir
from ringleader.cli_bench import add_bench_commands


def test_the_reader_and_resume_figures_are_measured_on_real_files(tmp_path):
    paths = write_token_dir(tmp_path / "tokens", tokens=50_000, shard_tokens=16_384)
    assert [p.stat().st_size for p in paths] == [32_768, 32_768, 32_768, 2 * (50_000 - 3 * 16_384)]
    assert np.fromfile(paths[0], dtype="<u2").max() < 256
    index = token_index(tmp_path / "tokens", seq_len=64)
    reader = reader_figures(index, batch=8, shards=4, samples=200, rounds=1)
    assert reader["samples"] == sum(p.stat().st_size // 2 // 64 for p in paths) and reader["files"] == 4
    assert reader["plain_samples_per_s"] > 0 and reader["ringleader_samples_per_s"] > 0
    resume = resume_figures(index, batch=8, shards=4)
    assert resume["files"] == 4 and resume["index_check_s"] > 0
    assert set(resume["first_shard_indices_s"]) == {"step_0", "after_1e6_samples"} and RESUME_SAMPLES == 10**6
    wait = {"recipe": "gpt", "source": "token files", "workers": 2, "steps": 10, "status": "finished", "data_wait_fraction": 0.004}
    text = format_figures({"reader": reader, "resume": resume, "data_wait": {"gpt_files": wait}})
    assert "x plain" in text and "(gpt from token files, 2 workers" in text and "0.40% of step time" in text
    assert "resume at 10^6 samples" in text


def test_bench_data_is_a_command():
    import argparse

    parser = argparse.ArgumentParser()
    add_bench_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "data", "--tokens", "1000", "--json", "out.json"])
    assert (args.bench, args.tokens, args.seq_len, args.json_path) == ("data", 1000, 1024, "out.json")
