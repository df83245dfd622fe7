"""What Prefect's API holds, as text: the tests that look for a secret everywhere read it whole."""

from __future__ import annotations

import json


def api_text(path: str) -> str:
    """Every page of one of Prefect's filter endpoints, as JSON text."""
    from prefect.client.orchestration import get_client

    out = []
    with get_client(sync_client=True) as client:
        if path == "/events/filter":  # 50 a page, then next_page links
            page = client._client.post(path, json={"limit": 50}).raise_for_status().json()
            out.append(json.dumps(page))
            while page.get("next_page"):
                page = client._client.get(page["next_page"]).raise_for_status().json()
                out.append(json.dumps(page))
            return "\n".join(out)
        for offset in range(0, 100_000, 200):
            items = client._client.post(path, json={"limit": 200, "offset": offset}).raise_for_status().json()
            out.append(json.dumps(items))
            if len(items) < 200:
                break
    return "\n".join(out)
