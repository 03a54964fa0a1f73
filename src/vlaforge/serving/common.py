"""What both transports of `vlaforge serve` apply alike - the websocket / HTTP server (server.py) and LeRobot's gRPC
service (lerobot_grpc.py): the API-key check and the kind a failure is counted under in `vlaforge_errors_total`.
A leaf of serving/: the two transports import it, it imports neither."""

from __future__ import annotations

import hmac

from vlaforge.errors import VlaforgeError
from vlaforge.serving import protocol


def authorized(api_key: str | None, header: str | None) -> bool:
    """openpi's `Api-Key KEY` header (or gRPC metadata) against the server's key, in constant time; any header is
    accepted when the server has no key."""
    if not api_key:
        return True
    return hmac.compare_digest((header or "").encode(), f"Api-Key {api_key}".encode())


def error_kind(exc: BaseException) -> str:
    """The metric label of a failed request: the client's message (`bad_message`), its observation
    (`bad_observation`), or the server itself (`internal`, logged)."""
    if isinstance(exc, protocol.RequestError):
        return "bad_message"
    if isinstance(exc, VlaforgeError):
        return "bad_observation"
    return "internal"
