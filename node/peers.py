"""How nodes talk to each other: state transfers, pulls and replicas.

These calls are control plane (rare, bulk), so they use httpx; the request
hot path never waits on them except for a pull-on-miss during a handoff.
"""

from __future__ import annotations

from typing import Any

import httpx

INTERNAL_TOKEN_HEADER = "X-Ringlimit-Token"  # noqa: S105 (a header name)


class PeerError(Exception):
    """A peer did not answer as expected (down, slow, or refused).

    ``status`` is the peer's HTTP status, or None when it did not answer.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        """Worth trying again: no answer, a conflict (409) or a server error."""
        return self.status is None or self.status == 409 or self.status >= 500


class Peers:
    def __init__(
        self,
        *,
        token: str | None = None,
        timeout: float = 2.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        headers = {INTERNAL_TOKEN_HEADER: token} if token else {}
        self._headers = headers
        self._owned = client is None
        self._client = client or httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 0.5)),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
        )

    async def post(
        self,
        url: str,
        path: str,
        payload: dict[str, Any],
        *,
        seconds: float | None = None,
    ) -> dict[str, Any]:
        """POST JSON; ``seconds`` overrides the default timeout for bulk transfers."""
        extra: dict[str, Any] = {} if seconds is None else {"timeout": seconds}
        try:
            response = await self._client.post(
                url.rstrip("/") + path, json=payload, headers=self._headers, **extra
            )
        except httpx.HTTPError as exc:
            raise PeerError(f"{url}{path}: {type(exc).__name__}") from None
        if response.status_code != 200:
            raise PeerError(f"{url}{path}: HTTP {response.status_code}", response.status_code)
        data: dict[str, Any] = response.json()
        return data

    async def close(self) -> None:
        if self._owned:
            await self._client.aclose()
