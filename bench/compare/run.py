"""Each peer run twice, clean and under ``ckpt soak``'s failures; their figures side by side."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from . import PEERS
from .report import figures
from .schedule import from_soak

RANKS = 2  # the peers train two shards' batches as two ranks (replicas): ``ckpt soak --shards 2``


def run_peers(peers: list[str], specs: list[str], *, rounds: int, steps_per_round: int, size: str, dcp_every: int,
              timeout_s: float, root: str) -> dict[str, Any]:
    """``peers`` (of ``PEERS``) through ``rounds * steps_per_round`` steps, clean then struck by
    ``specs`` (``ckpt soak``'s schedule). A peer that cannot run here gets ``{"error": ...}`` (why)."""
    from workloads.tinylm import TinyLMWorkload

    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"unknown peer {unknown}: choose from {', '.join(PEERS)}")
    strikes, unmapped = from_soak(specs, steps_per_round, RANKS)
    steps = rounds * steps_per_round
    budget = 300.0 + 120.0 * len(strikes) + 0.5 * steps  # a stuck job fails; a slow machine does not
    out: dict[str, Any] = {}
    for peer in peers:
        try:
            if peer == "torchft":
                from . import torchft_peer

                def once(d: str, s: list) -> list[dict[str, Any]]:
                    return torchft_peer.run(d, steps=steps, size=size, strikes=s, timeout_s=timeout_s, budget_s=budget)
            else:
                from . import torchrun_dcp

                def once(d: str, s: list) -> list[dict[str, Any]]:
                    return torchrun_dcp.run(d, steps=steps, every=dcp_every, size=size, strikes=s, timeout_s=timeout_s,
                                            budget_s=budget)
            clean = once(os.path.join(root, peer, "clean"), [])
            drilled = once(os.path.join(root, peer, "drilled"), strikes)
        except (ImportError, RuntimeError, OSError) as e:
            out[peer] = {"error": f"{type(e).__name__}: {e}"}
            continue
        out[peer] = figures(clean, drilled, strikes, ranks=RANKS,
                            batch_size=int(TinyLMWorkload.SIZES[size]["batch_size"]))
    if "torchrun-dcp" in out and "error" not in out["torchrun-dcp"]:
        out["torchrun-dcp"]["dcp_every"] = dcp_every
    return {"systems": out, "steps": steps, "strikes": [asdict(s) for s in strikes], "unmapped": unmapped}
