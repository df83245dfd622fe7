"""How a task reaches the run's store: ``StoreAccess`` resolved where the task runs (Prefect side).

``trainrun.credentials`` says where credentials may come from; this adds the one source that needs
Prefect: a ``Secret`` block, loaded by name in the process that opens the store, so neither a flow
nor a task parameter ever holds the secret itself.
"""

from __future__ import annotations

from typing import Any

from trainrun.credentials import StoreAccess


def load_secret_block(name: str) -> Any:
    """The value of the Prefect Secret block ``name`` (a dict, or a JSON string)."""
    from prefect.blocks.system import Secret

    try:
        return Secret.load(name).get()
    except ValueError as e:  # Prefect's "Unable to find block document named ..."
        raise ValueError(f"credentials block {name!r} cannot be loaded ({e}): create it with "
                         f"Secret(value={{...s3fs options...}}).save({name!r}), or name an existing one") from None


def storage_options(access: StoreAccess | None) -> dict[str, Any] | None:
    """The s3fs options ``access`` leads to (None: the environment's, for s3fs itself)."""
    return (access or StoreAccess()).resolve(load_secret_block)
