"""Every door of the local stack's SeaweedFS and report server, knocked on without credentials.

One SeaweedFS as the stack starts it (``SeaweedFS.start(locked=True)``) holds a checkpoint. Every
listening port of its process (found from the process, not from our own list) and the report server
get the destructive calls an outsider reproduced (issue 37): the master's ``/col/delete``,
``/dir/assign``, ``/vol/grow``, ``/vol/vacuum``; filer PUT/DELETE/GET of the bucket's objects;
volume server GET/POST/DELETE of a fid; S3 without a signature; over plain HTTP and over TLS
without a client certificate. Each must be refused, and the checkpoint restores afterwards. About
10 s; select with ``pytest tests/test_local_services.py`` (mark: s3).
"""

from __future__ import annotations

import http.client
import socket
import ssl
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployments.local_services import SeaweedFS

pytestmark = pytest.mark.s3

REPO = Path(__file__).resolve().parent.parent
BUCKET, RUN = "checkpoints", "runs/r1"
KEY = f"{RUN}/probe.bin"  # one plain object beside the checkpoint, to aim at by name
FID = "1,01637037d6"  # a volume server's file id, as /dir/assign hands them out
# (method, path) an outsider tries on every port (paths of the master, filer, volume server and S3 alike)
KNOCKS = [
    ("GET", f"/col/delete?collection={BUCKET}"), ("GET", "/col/delete?collection="),
    ("GET", "/dir/assign"), ("POST", "/dir/assign"), ("GET", "/vol/grow?count=1"), ("GET", "/vol/vacuum"),
    ("GET", f"/buckets/{BUCKET}/{KEY}"), ("PUT", f"/buckets/{BUCKET}/{KEY}"),
    ("DELETE", f"/buckets/{BUCKET}/{KEY}"), ("DELETE", f"/buckets/{BUCKET}?recursive=true"),
    ("GET", f"/{FID}"), ("POST", f"/{FID}"), ("DELETE", f"/{FID}"),
    ("GET", f"/{BUCKET}/{KEY}"), ("PUT", f"/{BUCKET}/{KEY}"), ("DELETE", f"/{BUCKET}/{KEY}"), ("DELETE", f"/{BUCKET}"),
]
# What a refusal looks like: a client error without the object, or no HTTP exchange at all (a TLS
# handshake that wants a client certificate, a gRPC port that hangs up on HTTP/1).
REFUSED = {400, 401, 403, 404, 405}


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    """(SeaweedFS started as the stack starts it, holding a checkpoint at step 3; the state saved)."""
    import torch

    from ckptlib import Checkpointer

    s3 = SeaweedFS.start(tmp_path_factory.mktemp("locked"), locked=True)
    try:
        s3.create_bucket(BUCKET)
        state = {"w": torch.arange(4096, dtype=torch.float32)}
        with Checkpointer(f"s3://{BUCKET}/{RUN}", s3.storage_options) as ck:
            ck.save(3, state)
        s3._client().put_object(Bucket=BUCKET, Key=KEY, Body=b"x" * 100)
        yield s3, state
    finally:
        s3.stop(grace=1.0)


def _knock(port: int, method: str, path: str, tls: bool) -> int | str:
    """The status of one request without credentials, or the name of what cut it short."""
    if tls:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # we have no CA: a client without credentials
        conn: http.client.HTTPConnection = http.client.HTTPSConnection("127.0.0.1", port, timeout=3, context=ctx)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
    try:
        conn.request(method, path, body=b"evil" if method in ("PUT", "POST") else None)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException) as e:  # ssl.SSLError is an OSError
        return type(e).__name__
    finally:
        conn.close()


def _wants_a_client_certificate(port: int) -> bool:
    """Whether ``port`` speaks TLS and hangs up on a client that shows no certificate (a plaintext
    gRPC port also fails a TLS handshake, but not with this alert)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3) as raw, \
                ctx.wrap_socket(raw) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            conn.recv(1)  # TLS 1.3: the server's verdict on our (missing) certificate comes with the first read
    except ssl.SSLError as e:
        return e.reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED"
    except OSError:
        return False
    return False


def _listening(pid: int) -> tuple[set[int], list[str]]:
    """(TCP ports, unix socket paths) that process ``pid`` listens on."""
    import psutil

    conns = psutil.Process(pid).net_connections(kind="all")
    tcp = {c.laddr.port for c in conns if c.type == socket.SOCK_STREAM and c.family != socket.AF_UNIX
           and c.status == psutil.CONN_LISTEN}
    unix = sorted({c.laddr for c in conns if c.family == socket.AF_UNIX and c.laddr})
    return tcp, unix


def _object_intact(s3: SeaweedFS, state: dict) -> None:
    import torch

    from ckptlib import Checkpointer

    assert s3._client().get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == b"x" * 100
    with Checkpointer(f"s3://{BUCKET}/{RUN}", s3.storage_options) as ck:
        restored = ck.restore(3)
    assert torch.equal(restored["w"], state["w"])


def test_no_port_of_seaweedfs_obeys_a_request_without_credentials(locked):
    """Every TCP port of the weed process refuses every knock, over HTTP and over TLS without a
    client certificate (before: the master deleted the bucket's collection, answering 204, and every
    GetObject failed after); every unix socket it listens on is its user's only; the data is intact."""
    s3, state = locked
    tcp, unix = _listening(s3.proc.pid)
    assert tcp == set(s3.ports.values()), f"a door nobody named: {tcp - set(s3.ports.values())}"
    obeyed = []
    for name, port in sorted(s3.ports.items()):
        for method, path in KNOCKS:
            for tls in (False, True):
                status = _knock(port, method, path, tls)
                if isinstance(status, int) and status not in REFUSED:
                    obeyed.append(f"{method} {'https' if tls else 'http'}://127.0.0.1:{port}{path} ({name}): {status}")
    assert not obeyed, "answered without credentials:\n" + "\n".join(obeyed)
    # S3 checks signatures; every other port (HTTP and gRPC alike) wants the stack's certificate ...
    open_ports = {name for name, port in s3.ports.items() if name != "s3" and not _wants_a_client_certificate(port)}
    assert not open_ports, f"ports that take a client without a certificate: {open_ports}"
    # ... which does open them (the refusals above are the certificate's doing, not a broken server)
    ctx = ssl.create_default_context(cafile=str(s3.data_dir / "tls" / "ca.pem"))
    ctx.load_cert_chain(s3.data_dir / "tls" / "cert.pem", s3.data_dir / "tls" / "key.pem")
    conn = http.client.HTTPSConnection("127.0.0.1", s3.ports["master"], timeout=5, context=ctx)
    conn.request("GET", "/cluster/status")
    assert conn.getresponse().status == 200
    conn.close()
    assert unix, "weed opens unix sockets in /tmp: the test no longer finds them"
    for path in unix:  # connecting to a unix socket takes write permission on it
        assert Path(path).stat().st_mode & 0o077 == 0, f"{path} is open to other users: {stat.filemode(Path(path).stat().st_mode)}"
    time.sleep(1)  # a collection deleted by the master is gone from the volume server a moment later
    _object_intact(s3, state)


def test_the_report_server_serves_reports_only_and_changes_nothing(locked, tmp_path):
    """The stack's report server, on the locked SeaweedFS: every write is 405, a checkpoint's manifest,
    chunks and the plain object are 404 (it serves reports only), and the data is intact after."""
    from deployments.stack import free_port

    s3, state = locked
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "AWS_ENDPOINT_URL": s3.endpoint, "AWS_ACCESS_KEY_ID": s3.reader[0],
           "AWS_SECRET_ACCESS_KEY": s3.reader[1], "AWS_EC2_METADATA_DISABLED": "true"}
    proc = subprocess.Popen([sys.executable, "-m", "deployments.report_server", "--port", str(port), "--bucket",
                             BUCKET, "--prefix", "runs"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while isinstance(_knock(port, "HEAD", "/", False), str) and time.monotonic() < deadline:
            time.sleep(0.1)
        keys = [o["Key"] for o in s3._client().list_objects_v2(Bucket=BUCKET)["Contents"]]
        assert len(keys) > 1
        for key in keys:
            for method in ("GET", "HEAD"):
                assert _knock(port, method, f"/buckets/{BUCKET}/{key}", False) == 404, key
            for method in ("PUT", "POST", "DELETE", "PATCH"):
                assert _knock(port, method, f"/buckets/{BUCKET}/{key}", False) == 405, key
        for method, path in KNOCKS:
            assert _knock(port, method, path, False) in (404, 405), (method, path)
    finally:
        proc.terminate()
        proc.wait(10)
    _object_intact(s3, state)
