"""A real S3 endpoint on localhost: moto's server in a thread of the test process, reached over
HTTP by pyarrow's S3 filesystem from any process (Ray workers included)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs


@dataclass(frozen=True)
class S3Endpoint:
    host: str
    port: int

    def uri(self, path: str) -> str:
        """``s3://`` URI of ``path`` (``bucket/key``) on this endpoint, its (fake) credentials
        in the userinfo, as a job names it."""
        return f"s3://key:secret@{path}?endpoint_override={self.host}:{self.port}&scheme=http&region=us-east-1"

    def filesystem(self) -> pyarrow.fs.S3FileSystem:
        return pyarrow.fs.S3FileSystem(
            access_key="key", secret_key="secret", endpoint_override=f"{self.host}:{self.port}", scheme="http",
            region="us-east-1", allow_bucket_creation=True,
        )

    def upload(self, local: Path, path: str) -> None:
        """Copy the file ``local`` to ``path`` (``bucket/key``), making the bucket if needed."""
        fs = self.filesystem()
        fs.create_dir(path.split("/", 1)[0])
        with fs.open_output_stream(path) as out:
            out.write(local.read_bytes())


@contextmanager
def s3_endpoint() -> Iterator[S3Endpoint]:
    """An S3 endpoint on 127.0.0.1 (a free port) for the duration of the block."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield S3Endpoint(host, port)
    finally:
        server.stop()
