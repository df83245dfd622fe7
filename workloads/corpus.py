"""Real text without a download: source files of the Python standard library, as bytes.

The corpus is a fixed list of pure-Python stdlib modules, read in that order from
``os.path.dirname(os.__file__)`` and concatenated up to ``max_bytes``. The same Python version gives
the same bytes on every machine (these modules are not patched by distributions, unlike ``site.py``
or ``sysconfig.py``; platform-generated files such as ``_sysconfigdata_*.py`` are never read).
A different Python version gives a different (equally good) text: ``corpus_info()`` reports a
digest, so a benchmark can record which text it trained on. The vocabulary is bytes (256 symbols)
and never depends on the text.

``path`` (a file or a directory of ``.py``/``.txt`` files, read in sorted order) replaces the
stdlib, e.g. where an embedded Python ships only ``.pyc``.
"""

from __future__ import annotations

import hashlib
import os
import threading

import torch

STDLIB_FILES = (
    "argparse.py", "typing.py", "dataclasses.py", "functools.py", "enum.py", "contextlib.py",
    "textwrap.py", "string.py", "heapq.py", "bisect.py", "fractions.py", "statistics.py", "copy.py",
    "csv.py", "difflib.py", "fnmatch.py", "glob.py", "shlex.py", "queue.py", "random.py", "shutil.py",
    "tempfile.py", "weakref.py", "operator.py", "pprint.py", "abc.py", "numbers.py", "colorsys.py",
    "graphlib.py", "calendar.py", "base64.py", "tokenize.py", "traceback.py", "ast.py", "inspect.py",
)
MIN_BYTES = 64 * 1024

_lock = threading.Lock()
_cache: dict[tuple[str, int], torch.Tensor] = {}


def _sources(path: str) -> list[str]:
    if path:
        if os.path.isfile(path):
            return [path]
        if os.path.isdir(path):
            return [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith((".py", ".txt"))]
        raise FileNotFoundError(f"corpus path {path!r} is neither a file nor a directory")
    stdlib = os.path.dirname(os.__file__)
    return [os.path.join(stdlib, f) for f in STDLIB_FILES if os.path.isfile(os.path.join(stdlib, f))]


def load_corpus(max_bytes: int, path: str = "") -> torch.Tensor:
    """The corpus as a uint8 tensor of at most ``max_bytes`` (cached per process; do not modify it)."""
    key = (path, int(max_bytes))
    with _lock:
        cached = _cache.get(key)
        if cached is not None:
            return cached
        chunks, total = [], 0
        for f in _sources(path):
            with open(f, "rb") as fh:
                data = fh.read()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        text = b"".join(chunks)[:max_bytes]
        if len(text) < min(MIN_BYTES, max_bytes):
            raise RuntimeError(f"found only {len(text)} bytes of text (need {min(MIN_BYTES, max_bytes)}) in "
                               f"{path or os.path.dirname(os.__file__)}: this Python may ship without its .py "
                               "sources; point extra={'corpus_path': <file or directory of text>} at some text")
        corpus = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        _cache[key] = corpus
        return corpus


def corpus_info(corpus: torch.Tensor) -> dict:
    return {"corpus_bytes": int(corpus.numel()),
            "corpus_sha256": hashlib.sha256(corpus.numpy().tobytes()).hexdigest()[:16]}
