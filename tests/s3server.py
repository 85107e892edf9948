"""A local S3-compatible server (moto) over HTTP on 127.0.0.1, for s3fs-backed tests."""

from __future__ import annotations

import os
import uuid

from tests.dist import free_port


class LocalS3:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

    @property
    def options(self) -> dict:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint},
            "skip_instance_cache": True,
        }

    def new_bucket(self) -> str:
        import s3fs

        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(**self.options).mkdir(name)
        return name

    def stop(self) -> None:
        self.server.stop()
