"""Pointer files: a small JSON file at the path a framework checkpoints to, naming a ckptlib step.

Training frameworks decide where checkpoints go and then look for them on a filesystem: Lightning's
``ModelCheckpoint`` checks ``exists``, lists its folder for ``last*.ckpt``, sorts by mtime and
symlinks ``last.ckpt``; Hugging Face's ``Trainer`` finds ``checkpoint-N`` folders and rotates them.
The integrations (``ckptlib.lightning``, ``ckptlib.hf``) keep all of that working by writing, where
the framework expects its checkpoint, a pointer::

    {"ckptlib": "pointer/1", "url": "s3://bucket/run", "step": 12, "name": "/runs/a/last.ckpt"}

The state itself is in the store. A pointer is written only after its step is committed (and
atomically, on a local disk), so a pointer never names a step that was not saved. A pointer is read
as untrusted input: its size is checked before it is read and every field is checked.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import CheckpointError

FORMAT = "pointer/1"
MAX_BYTES = 64 << 10  # a pointer is ~200 bytes; anything much larger is not one


class NotAPointer(CheckpointError, ValueError):
    """The file at a checkpoint path is not a ckptlib pointer (a torch checkpoint, say)."""


@dataclass(frozen=True)
class Pointer:
    url: str
    step: int
    name: str

    def to_json(self) -> bytes:
        return json.dumps({"ckptlib": FORMAT, "url": self.url, "step": self.step, "name": self.name}).encode()


def write(path: str, pointer: Pointer) -> None:
    """Write ``pointer`` at ``path`` (a local path or an fsspec URL), replacing what was there."""
    fs, p = fsspec.core.url_to_fs(path)
    data = pointer.to_json()
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(p, data)  # one PUT: object stores publish it whole or not at all
        return
    folder = os.path.dirname(os.path.abspath(p))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ckptlib-pointer-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)  # readers see the old pointer or the new one, never half of one
    except BaseException:
        os.unlink(tmp)
        raise


def exists(path: str) -> bool:
    fs, p = fsspec.core.url_to_fs(path)
    return bool(fs.exists(p))


def read(path: str) -> Pointer:
    """The pointer at ``path``; ``NotAPointer`` naming the path and why if the file is something else,
    ``FileNotFoundError`` if there is none."""
    fs, p = fsspec.core.url_to_fs(path)
    size = fs.size(p)
    if size is None or size > MAX_BYTES:
        raise NotAPointer(f"{path} is {size} bytes, not a ckptlib pointer (at most {MAX_BYTES}): "
                          "it is not a checkpoint ckptlib wrote (a torch.save file? ckptlib never unpickles: "
                          "load it with the framework's own checkpoint IO)")
    with fs.open(p, "rb") as f:
        raw = f.read(MAX_BYTES + 1)
    try:
        doc: Any = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        doc = None
    if type(doc) is not dict or doc.get("ckptlib") != FORMAT:
        raise NotAPointer(f"{path} is not a ckptlib pointer: it is not a checkpoint ckptlib wrote (a torch.save "
                          "file? ckptlib never unpickles: load it with the framework's own checkpoint IO)")
    url, step, name = doc.get("url"), doc.get("step"), doc.get("name")
    if type(url) is not str or type(step) is not int or step < 0 or type(name) is not str:
        raise NotAPointer(f"{path} is a damaged ckptlib pointer (url, step or name missing or of the wrong type): "
                          "delete it; the framework then saves a new one")
    return Pointer(url, step, name)


def check_url(path: str, pointer: Pointer, url: str) -> None:
    """A pointer is followed only into the store this integration writes: never to a URL read from a file."""
    if pointer.url != url:
        raise ValueError(f"{path} points into {pointer.url}, not into {url}, the store this integration was "
                         f"given: construct it with url={pointer.url!r} to load it")
