"""Who may change state, and proof that a form was ours.

One shared secret, ``TXBOX_DASHBOARD_TOKEN``. API clients send it as
``Authorization: Bearer <token>``; people paste it once into the login form and get an
HttpOnly, SameSite=Strict cookie holding an HMAC derived from the token (never the token
itself; changing the token logs everyone out). Forms carry a CSRF token derived from
that cookie, checked on every state-changing form POST. Without a configured token,
replay and discard are refused (403): a dashboard nobody secured must not change data.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from starlette.requests import Request

COOKIE = "txbox_session"


@dataclass(frozen=True)
class Auth:
    token: str | None
    view_requires_token: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.token)

    def _derive(self, purpose: str, value: str = "") -> str:
        assert self.token
        return hmac.new(self.token.encode(), f"{purpose}:{value}".encode(), hashlib.sha256).hexdigest()

    def session_value(self) -> str:
        return self._derive("session")

    def check_token(self, given: str) -> bool:
        return self.enabled and hmac.compare_digest(given.encode(), (self.token or "").encode())

    def bearer(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        return scheme.lower() == "bearer" and self.check_token(value.strip())

    def cookie(self, request: Request) -> bool:
        value = request.cookies.get(COOKIE, "")
        return self.enabled and hmac.compare_digest(value.encode(), self.session_value().encode())

    def authenticated(self, request: Request) -> bool:
        return self.enabled and (self.bearer(request) or self.cookie(request))

    def may_view(self, request: Request) -> bool:
        return not self.view_requires_token or self.authenticated(request)

    def csrf_token(self, request: Request) -> str:
        """The value forms embed; empty when not logged in (the form will be refused anyway)."""
        return self._derive("csrf", request.cookies.get(COOKIE, "")) if self.cookie(request) else ""

    def csrf_ok(self, request: Request, submitted: str) -> bool:
        if self.bearer(request):
            return True  # a header a cross-site form cannot set
        expected = self.csrf_token(request)
        return bool(expected) and hmac.compare_digest(submitted.encode(), expected.encode())
