"""The index of a job's data files, built once by the driver before any worker starts.

``files`` (a glob, a path or a URI, or a list of them) is expanded in order, each glob's
matches sorted; each file is described (its size, version and samples, ``workers/data/formats.py``)
in parallel: by Ray tasks on the cluster where Ray is up, else by threads. The index is kept in
the run directory (``data/<source>-index.json``, written atomically); a resumed run reads it back
and re-checks only each file's size and version, refusing a file that changed. Every problem is
a ConfigError naming the field or the file, before training.
"""

from __future__ import annotations

import fnmatch
import json
import os
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import pyarrow.fs

from jobspec.data_index import DataIndex, IndexedFile, changes
from jobspec.durable import write_atomic
from jobspec.fields import ConfigError, first_line
from jobspec.recipe import DataSource
from jobspec.redaction import redact, redact_all
from workers.data.files import file_spec
from workers.data.formats import FORMATS, DataFileError, filesystem_of, split_uri

GLOB_CHARS = "*?["
#: Files described per Ray task: a task costs ~ms to schedule, a small file's description less.
FILES_PER_TASK = 16


def refused(field: str, problem: str) -> ConfigError:
    """The one line a bad data source is refused with, naming its field."""
    return ConfigError(f"invalid job: field '{field}': {problem}")


def _split(entry: str) -> tuple[str, str, str]:
    """``split_uri`` of ``entry``, a local path made absolute: workers may run in another
    directory than the driver."""
    prefix, path, query = split_uri(entry)
    return (prefix, path, query) if prefix else ("", os.path.abspath(entry), "")


def _stat(uri: str) -> pyarrow.fs.FileInfo:
    fs, path = filesystem_of(uri)
    return fs.get_file_info(path)


def expand(files: str | Sequence[str], field: str) -> list[str]:
    """The file URIs (or paths) ``files`` names, in order: a glob's matches sorted, a directory's
    files sorted. Raises ConfigError naming ``field`` for an entry that matches or holds no file."""
    uris: list[str] = []
    for entry in [files] if isinstance(files, str) else files:
        prefix, path, query = _split(entry)
        try:
            if any(c in path for c in GLOB_CHARS):
                cut = min(path.index(c) for c in GLOB_CHARS if c in path)
                base = path[: path.rfind("/", 0, cut) + 1] or "."
                found = _listing(prefix + base + query)
                pattern = path.removeprefix("./").split("/")
                matches = sorted(p for p in found if _matches(p.removeprefix("./").split("/"), pattern))
            else:
                info = _stat(entry)
                if info.type == pyarrow.fs.FileType.NotFound:
                    raise refused(field, f"{redact(entry)} does not exist")
                directory = info.type == pyarrow.fs.FileType.Directory
                matches = sorted(_listing(prefix + path + query)) if directory else [path]
        except (OSError, pyarrow.ArrowException) as err:  # pyarrow's text may repeat the URI: masked
            raise refused(field, f"cannot list {redact(entry)} ({redact(str(err))})") from None
        if not matches:
            raise refused(field, f"{redact(entry)} matches no file")
        uris += [prefix + match + query for match in matches]
    return uris


def _matches(parts: list[str], pattern: list[str]) -> bool:
    """Whether a path (split at ``/``) matches a glob (split the same way) as a shell's does: a
    ``*`` stays inside one name, ``**`` spans any number of directories."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _matches(parts[1:], pattern[1:])


def _listing(uri: str) -> list[str]:
    """Every file under the directory ``uri``, as paths on its filesystem."""
    fs, path = filesystem_of(uri)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=True, allow_not_found=True))
    return [info.path for info in infos if info.type == pyarrow.fs.FileType.File]


def describe(uris: list[str], format: str, spec: dict[str, Any]) -> list[IndexedFile]:
    """Each file of ``uris`` as the index holds it. Raises DataFileError naming a bad file."""
    described = []
    for uri in uris:
        try:
            info = _stat(uri)
            if info.type != pyarrow.fs.FileType.File:
                raise DataFileError(f"{redact(uri)}: no longer a file")
            samples, layout = FORMATS[format].describe(uri, info.size, spec)
        except (OSError, pyarrow.ArrowException) as err:
            raise DataFileError(f"{redact(uri)}: cannot read it ({redact(first_line(err))})") from None
        described.append(IndexedFile(uri, info.size, info.mtime_ns or 0, samples, layout))
    return described


def _describe_in_parallel(uris: list[str], format: str, spec: dict[str, Any], timeout_s: float) -> list[IndexedFile]:
    """``describe`` over ``uris``: as Ray tasks of FILES_PER_TASK files where Ray is up and
    there are more, else on threads, a file each. Raises DataFileError for a bad file and
    ConfigError past ``timeout_s`` (a storage that does not answer)."""
    chunks = [uris[i : i + FILES_PER_TASK] for i in range(0, len(uris), FILES_PER_TASK)]
    import ray

    if ray.is_initialized() and len(chunks) > 1:
        task = ray.remote(num_cpus=0.25, max_retries=2)(describe)
        refs = [task.remote(chunk, format, spec) for chunk in chunks]
        try:
            parts = ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            for ref in refs:
                ray.cancel(ref, force=True)
            raise ConfigError(f"indexing {len(uris)} data files took longer than {timeout_s:.0f}s") from None
        except ray.exceptions.RayTaskError as err:
            cause = err.as_instanceof_cause()
            if isinstance(cause, DataFileError):
                raise DataFileError(first_line(cause)) from None
            raise DataFileError(f"indexing failed: {redact(first_line(cause))}") from None
        return [entry for part in parts for entry in part]
    pool = ThreadPoolExecutor(max_workers=8)
    futures = [pool.submit(describe, [uri], format, spec) for uri in uris]
    done, pending = wait_futures(futures, timeout=timeout_s)
    pool.shutdown(wait=False, cancel_futures=True)  # a read stuck for good is left behind
    if pending:
        raise ConfigError(f"indexing {len(uris)} data files took longer than {timeout_s:.0f}s")
    return [entry for future in futures for entry in future.result()]


def index_path(run_dir: Path, name: str) -> Path:
    return run_dir / "data" / f"{name}-index.json"


def build_index(source: DataSource, name: str, timeout_s: float) -> DataIndex:
    """The index of ``source``'s files (``name``: ``dataset`` or ``eval``, for messages).
    Raises ConfigError naming the field or the bad file."""
    assert source.files is not None and source.format is not None
    spec = file_spec(source)
    uris = expand(source.files, f"{name}.files")
    try:
        files = _describe_in_parallel(uris, source.format, spec, timeout_s)
    except DataFileError as err:
        raise refused(f"{name}.files", str(err)) from None
    empty = next((entry for entry in files if entry.samples == 0), None)
    if empty is not None:
        window = f" of seq_len {source.seq_len}" if source.seq_len else ""
        raise refused(f"{name}.files", f"{redact(empty.uri)} ({empty.bytes} bytes) holds no sample{window}")
    # Samples of every file are batched together: .npy rows of one dtype and width only.
    shape = [(entry.layout.get("dtype"), entry.layout.get("row_items")) for entry in files]
    odd = next((entry for entry, found in zip(files, shape) if found != shape[0]), None)
    if odd is not None:
        raise refused(
            f"{name}.files", f"{redact(odd.uri)} holds rows of {odd.layout.get('row_items')} "
            f"{odd.layout.get('dtype')} items, other files another shape or type: samples of one source must stack"
        )
    return DataIndex(source.format, spec, tuple(files))


def checked_index(saved: DataIndex, name: str) -> DataIndex:
    """``saved`` (a resumed run's index) if every file is still as it was indexed; raises
    ConfigError naming the first file that is gone or changed, and what changed."""
    for entry in saved.files:
        try:
            info = _stat(entry.uri)
        except OSError as err:
            problem = f"{redact(entry.uri)}: cannot read it ({redact(first_line(err))})"
            raise refused(f"{name}.files", problem) from None
        if info.type != pyarrow.fs.FileType.File:
            raise refused(f"{name}.files", f"{redact(entry.uri)} is gone since the run indexed it")
        now = IndexedFile(entry.uri, info.size, info.mtime_ns or 0, entry.samples)
        found = changes(entry, now)
        if found:
            raise refused(
                f"{name}.files", f"{redact(entry.uri)} changed since the run indexed it "
                f"({', '.join(found)}); a run resumes only on the data it started with"
            )
    return saved


def _with_credentials(saved: DataIndex, source: DataSource, name: str) -> DataIndex:
    """``saved`` (its URIs' credentials masked) with the URIs ``source.files`` names now, which
    carry them. Raises ConfigError naming a file the run indexed that they no longer name."""
    assert source.files is not None
    now = {redact(uri): uri for uri in expand(source.files, f"{name}.files")}
    files = []
    for entry in saved.files:
        if entry.uri not in now:
            raise refused(f"{name}.files", f"{entry.uri} is gone since the run indexed it (or no longer listed)")
        files.append(replace(entry, uri=now[entry.uri]))
    return replace(saved, files=tuple(files))


def run_indexes(
    sources: dict[str, DataSource | None], run_dir: Path, resuming: bool, timeout_s: float,
    note: Callable[[str], None] = lambda message: None,
) -> dict[str, DataIndex]:
    """The index of each file source of ``sources`` (by name): a resumed run's own, checked
    (``checked_index``), else built (``build_index``) and kept in ``run_dir``. ``note`` is told
    what was indexed."""
    indexes = {}
    for name, source in sources.items():
        if source is None or source.files is None:
            continue
        path = index_path(run_dir, name)
        if resuming and path.is_file():
            saved = DataIndex.from_json(json.loads(path.read_text()))
            index = checked_index(_with_credentials(saved, source, name), name)
        else:
            index = build_index(source, name, timeout_s)
            path.parent.mkdir(parents=True, exist_ok=True)
            # Credentials in a URI stay out of the run directory (they come again with the job).
            text = json.dumps(redact_all(index.to_json())).encode()
            write_atomic(path, lambda out: out.write(text))
        note(f"{name}: {index.samples} samples in {len(index.files)} {index.format} file(s)")
        indexes[name] = index
    return indexes
