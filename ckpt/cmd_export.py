"""``ckpt export``: one checkpoint as a ``.pt`` (``torch.load(weights_only=True)``) or
``.safetensors`` file (``ckptlib.export``), written atomically; nothing is written to the store.

``--select PATH`` (repeatable) exports only those values (``Checkpointer.export(select=)``): with one
PATH the file holds that value itself, so ``--select coordinator/model`` of a training run gives
the trained model's weights under their own ``state_dict`` names.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .app import app
from .common import StepOpt, StorageOptionsOpt, UrlArg, command_errors, fail, fmt_bytes, open_checkpointer


@app.command("export")
def export(url: UrlArg,
           out: Annotated[str, typer.Option("--out", metavar="FILE", help="Output file: *.pt or *.safetensors.")],
           step: StepOpt = None, storage_options: StorageOptionsOpt = None,
           select: Annotated[Optional[list[str]], typer.Option(
               "--select", metavar="PATH",
               help="Export only this value (repeatable): a '/'-path as restore(select=) takes it; in a multi-part "
                    "checkpoint it starts with the part, e.g. coordinator/model (a training run's model). One PATH: "
                    "the file holds that value itself, its names relative to it.")] = None,
           force: Annotated[bool, typer.Option("--force", help="Replace FILE if it exists.")] = False,
           convert: Annotated[bool, typer.Option(
               "--convert", help="Write values the format cannot hold exactly as the nearest ones it holds "
                                 "(numpy arrays as tensors, ...), listing each.")] = False) -> None:
    """Write one checkpoint (default: the latest), or the values --select names, as a .pt or .safetensors file.

    .pt loads with torch.load(weights_only=True). The file is written atomically (a temp file beside
    it, renamed); an existing FILE is replaced only with --force. A value the format cannot hold
    exactly is refused, naming its path and type, unless --convert is given: then every conversion
    is listed. The trained model of a training run, under its own state_dict names: --select
    coordinator/model."""
    with command_errors():
        from ckptlib.export import format_of

        format_of(out)
        with open_checkpointer(url, storage_options) as ck:
            m = ck.manifest(step)
            try:
                done = ck.export(m.step, out, force=force, convert=convert, select=select)
            except KeyError as e:  # a path that is not in the state
                fail(str(e.args[0]) if e.args else str(e))
        for line in done.converted[:_LISTED]:
            typer.echo(f"converted {line}")
        if len(done.converted) > _LISTED:
            typer.echo(f"converted ... and {len(done.converted) - _LISTED} more values")
        what = f"{', '.join(select)} of step" if select else "step"
        typer.echo(f"exported {what} {m.step} (digest {m.digest}) of {ck.url} to {out} ({fmt_bytes(done.size)})"
                   + (f", {len(done.converted)} values converted" if done.converted else ""))


_LISTED = 50  # conversions listed one per line
