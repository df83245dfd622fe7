"""``CheckpointStore``: a Prefect block holding where runs live AND how to reach it (docs/security.md).

One block per store: ``url`` (``s3://bucket/prefix``, a directory; never credentials) and
``storage_options`` (the s3fs options: ``endpoint_url``, ``key``, ``secret``, ...; a ``SecretDict``,
so Prefect encrypts them at rest and masks them in its UI and API). A run names the block
(``store_block``, ``ckpt train --store-block NAME``); the URL is read where the run's parameters are
validated and the options only where a store is opened (``tasks/access.py``): a flow run's
parameters, logs and artifacts hold the block's name, never its secret.

Create one in Python (registers the block type too)::

    CheckpointStore(url="s3://checkpoints/runs",
                    storage_options={"endpoint_url": "https://s3.example", "key": "...", "secret": "..."}).save("prod")

or in the UI (Blocks > Checkpoint Store) once ``prefect block register -m tasks.store_block`` ran.
"""

from __future__ import annotations

from typing import Any, cast

from prefect.blocks.core import Block
from prefect.types import SecretDict
from pydantic import Field, field_validator

from trainrun.credentials import check_url

BLOCK_TYPE = "checkpoint-store"
CREATE = ('create it: CheckpointStore(url="s3://bucket/prefix", storage_options={"endpoint_url": ..., "key": ..., '
          '"secret": ...}).save(NAME) (tasks/store_block.py), or in the UI after `prefect block register -m '
          'tasks.store_block`')


class CheckpointStore(Block):
    """Where runs live and the s3fs options that reach it (masked, encrypted by Prefect)."""

    _block_type_name = "Checkpoint Store"
    _block_type_slug = BLOCK_TYPE
    _description = ("Where checkpoint runs live (url) and the s3fs options that reach it (storage_options: "
                    "endpoint_url, key, secret, ...), for the train-run flow's store_block.")

    url: str = Field(description="Where runs live: s3://bucket/prefix, file:///abs/path or a directory. No "
                     "credentials in it: they go to storage_options.")
    storage_options: SecretDict = Field(default_factory=lambda: SecretDict({}),
                                        description="s3fs options as JSON: endpoint_url, key, secret, "
                                                    "client_kwargs, ... (empty for a directory).")

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("url must not be empty: s3://bucket/prefix, file:///abs/path or a directory")
        return check_url(v.strip())

    def options(self) -> dict[str, Any] | None:
        """The s3fs options (None when empty: a local store, or the environment's)."""
        return dict(self.storage_options.get_secret_value()) or None


def load_store(name: str) -> CheckpointStore:
    """The ``CheckpointStore`` block ``name``; ValueError naming it and the fix when there is none
    (or the block of that name is of another type)."""
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise ValueError(f"store block {name!r} needs the Prefect server that holds it: set PREFECT_API_URL "
                         "(without it Prefect starts a temporary server, which holds no block)")
    try:
        return cast(CheckpointStore, CheckpointStore.load(name))  # sync here (typed as maybe a coroutine)
    except ValueError:  # Prefect's "Unable to find block document named ..."
        other = _type_of(name)
    if other is None:
        raise ValueError(f"store block {name!r} does not exist on this Prefect server: "
                         f"{CREATE.replace('NAME', repr(name))}; or name an existing one") from None
    raise ValueError(f"store block {name!r} is a {other!r} block, not a {BLOCK_TYPE!r}: a store block holds the "
                     f"URL and the s3fs options ({CREATE.replace('NAME', repr(name))})"
                     + ("; a Secret of s3fs options alone goes to credentials_block (--credentials-block)"
                        if other == "secret" else "")) from None


def _type_of(name: str) -> str | None:
    """The type slug of a block document called ``name`` (secrets not asked for), or None."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        found = client.request("POST", "/block_documents/filter",
                               json={"block_documents": {"name": {"any_": [name]}}, "include_secrets": False,
                                     "limit": 1}).json()
    return ((found[0].get("block_type") or {}).get("slug") or found[0].get("block_type_name")) if found else None
