"""How a task reaches the run's store: ``StoreAccess`` resolved where the task runs (Prefect side).

``trainrun.credentials`` says where credentials may come from; this adds the sources that need
Prefect: a block, loaded by name in the process that opens the store, so neither a flow nor a task
parameter ever holds the secret itself. A name is a ``Secret`` block holding the s3fs options; a
Prefect block slug ``checkpoint-store/NAME`` is a ``CheckpointStore`` block's options
(``tasks/store_block.py``: what ``store_block`` becomes), ``secret/NAME`` a Secret again.
"""

from __future__ import annotations

from typing import Any

from trainrun.credentials import StoreAccess


def load_secret_block(name: str) -> Any:
    """The s3fs options the block ``name`` holds (a dict, or a JSON string); see the module docstring."""
    from prefect.blocks.system import Secret

    kind, _, bare = name.rpartition("/")
    if kind == "checkpoint-store":
        from tasks.store_block import load_store

        return load_store(bare).options() or {}
    if kind not in ("", "secret"):
        raise ValueError(f"credentials block {name!r}: a {kind!r} block holds no s3fs options here: name a Secret "
                         "block (NAME or secret/NAME) or a Checkpoint Store (store_block, checkpoint-store/NAME)")
    try:
        return Secret.load(bare).get()
    except ValueError as e:  # Prefect's "Unable to find block document named ..."
        raise ValueError(f"credentials block {bare!r} cannot be loaded ({e}): create it with "
                         f"Secret(value={{...s3fs options...}}).save({bare!r}), or name an existing one") from None


def storage_options(access: StoreAccess | None) -> dict[str, Any] | None:
    """The s3fs options ``access`` leads to (None: the environment's, for s3fs itself)."""
    return (access or StoreAccess()).resolve(load_secret_block)
