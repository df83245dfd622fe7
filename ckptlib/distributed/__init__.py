"""ckptlib in torch.distributed jobs: collective saves of DDP, FSDP2 and DTensor states, one commit
across ranks, restores onto any layout (docs/distributed.md).

Modules, one idea each: ``documents`` (the rank and group fragments), ``pieces`` (geometry of boxes
of a global tensor), ``local`` (a rank's state as local leaves), ``plan`` (who stores what: values
identical on every rank stored once), ``group`` (a group's part checked together), ``collective``
(the checkpointer's own gloo group), ``saving`` and ``restoring``, and ``collective_checkpointer``
(the ``CollectiveCheckpointer`` around them: what ``Checkpointer(process_group=...)`` makes, the
public face). Importing this package loads neither torch nor torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import Any

# the names a caller of Checkpointer.read_rank / write_group needs, loaded on first use
_EXPORTS = {"RankState": "restoring", "ShardInfo": "local", "GroupFragment": "documents", "GroupFailed": "collective",
            "CollectiveCheckpointer": "collective_checkpointer"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptlib.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
