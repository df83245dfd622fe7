"""The ``ckpt`` command (``ckpt/cli.py``). It needs the CLI's extras (typer, rich): ``main`` says so
instead of a traceback when a core-only install (``pip install ckptlib``) runs it."""


def main() -> None:
    try:
        from .cli import main as run
    except ModuleNotFoundError as e:
        if e.name in ("typer", "rich", "click"):
            raise SystemExit(f"error: the ckpt command needs {e.name}, which a core install of ckptlib leaves out; "
                             "install the command line with: pip install 'ckptlib[pipeline]'") from None
        raise
    run()
