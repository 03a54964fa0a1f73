"""What both transports of `vlaforge serve` apply alike - the websocket / HTTP server (server.py) and LeRobot's gRPC
service (lerobot_grpc.py): the API-key check, the refusal of a non-finite action chunk, and the kind a failure is
counted under in `vlaforge_errors_total`. A leaf of serving/: the transports and the batcher import it, it imports
none of them."""

from __future__ import annotations

import hmac

from vlaforge.errors import VlaforgeError
from vlaforge.serving import protocol


class NonFiniteActions(VlaforgeError):
    """The policy predicted NaN or inf for a request: the chunk is withheld (a robot must never be sent it)."""

    def __init__(self):
        super().__init__("the policy produced non-finite actions (NaN or inf) for this observation, so none were "
                         "sent; check the checkpoint's weights and its normalization statistics (NaN or inf values, "
                         "a zero std)")


def authorized(api_key: str | None, header: str | None) -> bool:
    """openpi's `Api-Key KEY` header (or gRPC metadata) against the server's key, in constant time; any header is
    accepted when the server has no key."""
    if not api_key:
        return True
    return hmac.compare_digest((header or "").encode(), f"Api-Key {api_key}".encode())


def error_kind(exc: BaseException) -> str:
    """The metric label of a failed request: the client's message (`bad_message`), its observation
    (`bad_observation`), the policy's output (`nonfinite_actions`), or the server itself (`internal`, logged)."""
    if isinstance(exc, NonFiniteActions):
        return "nonfinite_actions"
    if isinstance(exc, protocol.RequestError):
        return "bad_message"
    if isinstance(exc, VlaforgeError):
        return "bad_observation"
    return "internal"


def server_fault(exc: BaseException) -> bool:
    """Whether a failed request is the server's doing (its policy or its code), not the client's: HTTP 500, gRPC
    INTERNAL and a log line, rather than a 400 / INVALID_ARGUMENT the client can fix."""
    return error_kind(exc) in ("internal", "nonfinite_actions")
