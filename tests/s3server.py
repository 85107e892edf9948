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


class WithoutConditionalDeletes:
    """An S3-compatible endpoint in front of ``LocalS3`` that forwards every request but answers
    a DELETE carrying ``If-Match`` with 501 NotImplemented, as S3-compatible servers without
    conditional deletes do (AWS itself has them since 2025)."""

    def __init__(self, upstream: LocalS3) -> None:
        import http.client
        import http.server
        import threading

        target = ("127.0.0.1", upstream.port)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "DELETE" and self.headers.get("If-Match"):
                    error = (
                        b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NotImplemented"
                        b"</Code><Message>A header you provided implies functionality that is "
                        b"not implemented</Message></Error>"
                    )
                    self.send_response(501)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                conn = http.client.HTTPConnection(*target, timeout=60)
                try:
                    conn.request(self.command, self.path, body, dict(self.headers.items()))
                    reply = conn.getresponse()
                    data = reply.read()
                finally:
                    conn.close()
                self.send_response(reply.status)
                for k, v in reply.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.options = {
            **upstream.options,
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{self.port}"},
        }

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
