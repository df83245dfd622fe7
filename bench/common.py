"""What the scale benchmarks share: the small model, a store (SeaweedFS S3 started here, or a local
folder), a Dask cluster from the ``dask`` CLI, tables and JSON records."""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# The small model every scale benchmark trains: tinylm with 2 layers of width 64 (135 k parameters;
# a shard's part with its AdamW moments is 1.6 MB, the coordinator's 0.6 MB; 29 tensors per model).
SMALL = {"d_model": 64, "n_layers": 2, "ctx": 32, "corpus_bytes": 65536}
BUCKET = "scale"
ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "host": platform.node(),
            "load_avg": [round(x, 2) for x in os.getloadavg()], "time": time.strftime("%Y-%m-%d %H:%M:%S")}


@contextmanager
def store_root(kind: str, workdir: Path) -> Iterator[tuple[str, dict | None]]:
    """``(url, storage_options)`` of an empty store root: ``s3`` (a SeaweedFS server started here,
    stopped at the end) or ``local`` (a folder under ``workdir``)."""
    if kind == "local":
        yield str(workdir / "store"), None
        return
    if kind != "s3":
        raise ValueError(f"unknown store kind {kind!r}: use s3 or local")
    from deployments.local_services import SeaweedFS

    with SeaweedFS.start(workdir / "seaweedfs") as s3:
        s3.create_bucket(BUCKET)
        yield f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}", dict(s3.storage_options)


def worker_env(storage_options: dict | None) -> dict[str, str]:
    """What a Dask worker machine needs: the project on its path and the store's credentials (in the
    environment, never on a command line)."""
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if storage_options:
        env["CKPT_STORAGE_OPTIONS"] = json.dumps(storage_options)
    return env


def workdir(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"ckpt-{name}-"))


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A markdown table of ``rows`` with ``(key, header)`` columns."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    out = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(r.get(k, "")) for k, _ in columns) + " |" for r in rows]
    return "\n".join(out)


def save_json(path: str | None, records: Any) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(records, indent=2, default=str))
        print(f"records written to {path}")
