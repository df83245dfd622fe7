"""The stack's report server: the validation reports in the bucket, read-only, over plain HTTP.

    python -m deployments.report_server --host 127.0.0.1 --port 8888 --bucket checkpoints --prefix runs

(``make stack`` starts it as the service ``reports``.) Contract:

* ``GET`` and ``HEAD`` of ``/buckets/<bucket>/<key>`` answer with the object when ``key`` is a
  report (``is_report``): under ``<prefix>/``, one to three folders of runs, then ``reports/``, then
  ``index.html`` / ``run.png`` (a run's index) or ``<step>/<file>`` with a report's file type
  (.html .png .csv .json .css .js .svg .txt). A path ending in ``/`` means its ``index.html``.
  Anything else, a manifest, a chunk, a verdict, another bucket, a path with ``..``: 404. Every
  other method (PUT, POST, DELETE, PATCH, ...): 405. Nothing is ever written.
* It reads the bucket through S3 with the stack's **read-only** identity (``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY`` / ``AWS_ENDPOINT_URL`` of its environment, never its command line), so
  even a bug here could not write. SeaweedFS's own filer, which would serve (and accept writes to)
  every object without credentials, answers only the stack's own certificate
  (``SeaweedFS.start(locked=True)`` in ``deployments/local_services.py``).
* It binds the stack's host (loopback by default) only. Pages are served with
  ``X-Content-Type-Options: nosniff`` and a Content-Security-Policy that lets a report load only
  from this server (the reports need no CDN: ``docs/deployments.md``).

Standard library plus botocore (installed with s3fs).
"""

from __future__ import annotations

import argparse
import mimetypes
import os
import re
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SERVER_NAME = "ckpt-reports"  # its Server header: how the stack tells it from another process on the port
REPORT_TYPES = (".html", ".png", ".csv", ".json", ".css", ".js", ".svg", ".txt")
MAX_RUN_DEPTH = 3  # as trainrun.layout.find_runs: a run is at most three folders below the store root
CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data:; connect-src 'self'; form-action 'none'; frame-ancestors 'self'")
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_report(key: str, prefix: str) -> bool:
    """Whether ``key`` (an object key of the bucket) is a report the server may serve (module docstring)."""
    parts = key.split("/")
    root = [p for p in prefix.strip("/").split("/") if p]
    if parts[:len(root)] != root or not all(_SEGMENT.match(p) for p in parts):
        return False
    rest = parts[len(root):]
    if "reports" not in rest[1:MAX_RUN_DEPTH + 1]:
        return False
    at = rest.index("reports", 1)
    tail = rest[at + 1:]
    if len(tail) == 1:
        return tail[0] in ("index.html", "run.png")
    return len(tail) >= 2 and tail[0].isdigit() and tail[-1].lower().endswith(REPORT_TYPES)


class ReportServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], bucket: str, prefix: str, client: Any):
        self.bucket, self.prefix, self.client = bucket, prefix, client
        super().__init__(address, Handler)


class Handler(BaseHTTPRequestHandler):
    server: ReportServer
    server_version = SERVER_NAME
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 - the http.server protocol
        self._serve(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(body=False)

    def _refuse(self) -> None:
        self._plain(405, "read-only: only GET and HEAD of reports\n", {"Allow": "GET, HEAD"})

    do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _refuse  # noqa: N815

    def _serve(self, body: bool) -> None:
        key = self._key()
        if key is None or not is_report(key, self.server.prefix):
            self._plain(404, "not a report\n", body=body)
            return
        try:
            obj = self.server.client.get_object(Bucket=self.server.bucket, Key=key)
            data = obj["Body"].read()
        except Exception as e:  # noqa: BLE001 - a missing object, S3 down: the browser gets a status, not a trace
            code = getattr(e, "response", {}).get("Error", {}).get("Code")
            self._plain(404 if code in ("NoSuchKey", "404") else 502, "not found\n" if code else "store error\n",
                        body=body)
            return
        ctype = mimetypes.guess_type(key)[0] or "application/octet-stream"
        self.send_response(200)
        for name, value in (("Content-Type", ctype + ("; charset=utf-8" if ctype.startswith("text/") else "")),
                            ("Content-Length", str(len(data))), ("Cache-Control", "no-cache"),
                            ("X-Content-Type-Options", "nosniff"), ("Content-Security-Policy", CSP)):
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _key(self) -> str | None:
        """The object key of ``/buckets/<bucket>/<key>`` (``.../`` -> ``.../index.html``), or None."""
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        head = f"/buckets/{self.server.bucket}/"
        if not path.startswith(head) or "\\" in path or "\0" in path:
            return None
        key = path[len(head):]
        return key + "index.html" if key.endswith("/") else key

    def _plain(self, code: int, text: str, headers: dict[str, str] | None = None, body: bool = True) -> None:
        data = text.encode()
        self.send_response(code)
        for name, value in {"Content-Type": "text/plain; charset=utf-8", "Content-Length": str(len(data)),
                            **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the http.server signature
        sys.stderr.write(f"{self.address_string()} {format % args}\n")


def s3_client() -> Any:
    """A botocore S3 client from this process's environment (the read-only identity)."""
    import botocore.session
    from botocore.config import Config

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"], aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        config=Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 3, "mode": "standard"}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deployments.report_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8888)
    ap.add_argument("--bucket", required=True)
    ap.add_argument("--prefix", default="runs", help="the store root in the bucket: only reports under it")
    a = ap.parse_args(argv)
    try:
        server = ReportServer((a.host, a.port), a.bucket, a.prefix, s3_client())
    except OSError as e:
        print(f"the report server cannot listen on {a.host}:{a.port}: {e.strerror or e} "
              "(another process holds the port?): stop it or choose another port (--reports-port)",
              file=sys.stderr, flush=True)
        return 2
    print(f"serving the reports of s3://{a.bucket}/{a.prefix} read-only on http://{a.host}:{a.port}/buckets/",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
