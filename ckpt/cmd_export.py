"""``ckpt export``: one checkpoint as a ``.pt`` (``torch.load(weights_only=True)``) or
``.safetensors`` file (``ckptlib.export``), written atomically; nothing is written to the store.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .cli import app
from .common import StepOpt, StorageOptionsOpt, UrlArg, command_errors, fmt_bytes, open_checkpointer


@app.command("export")
def export(url: UrlArg,
           out: Annotated[str, typer.Option("--out", metavar="FILE", help="Output file: *.pt or *.safetensors.")],
           step: StepOpt = None, storage_options: StorageOptionsOpt = None,
           force: Annotated[bool, typer.Option("--force", help="Replace FILE if it exists.")] = False,
           convert: Annotated[bool, typer.Option(
               "--convert", help="Write values the format cannot hold exactly as the nearest ones it holds "
                                 "(numpy arrays as tensors, ...), listing each.")] = False) -> None:
    """Write one checkpoint (default: the latest) as a .pt (torch.load(weights_only=True)) or .safetensors file.

    The file is written atomically (a temp file beside it, renamed); an existing FILE is replaced
    only with --force. A value the format cannot hold exactly is refused, naming its path and type,
    unless --convert is given: then every conversion is listed."""
    with command_errors():
        from ckptlib.export import format_of

        format_of(out)
        with open_checkpointer(url, storage_options) as ck:
            m = ck.manifest(step)
            done = ck.export(m.step, out, force=force, convert=convert)
        for line in done.converted[:_LISTED]:
            typer.echo(f"converted {line}")
        if len(done.converted) > _LISTED:
            typer.echo(f"converted ... and {len(done.converted) - _LISTED} more values")
        typer.echo(f"exported step {m.step} (digest {m.digest}) of {ck.url} to {out} ({fmt_bytes(done.size)})"
                   + (f", {len(done.converted)} values converted" if done.converted else ""))


_LISTED = 50  # conversions listed one per line
