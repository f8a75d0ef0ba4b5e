"""The operator's dashboard: one self-contained page (gateway/static/) that polls the admin API, its
login, and ``GET /admin/series``.

The page needs the admin token. A person types it into the login form (or opens ``/dashboard?token=…``
once, which redirects to drop it from the address bar and history); either way the browser then holds
only an HttpOnly, SameSite=Strict session cookie: an expiry and an HMAC of it keyed by the admin
token's SHA-256, so rotating the token ends every session. The token itself is never logged, echoed
or stored. The page only polls, so it costs the request path nothing but the snapshot it reads.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from importlib import resources

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from gateway.bearer import bearer_token
from gateway.errors import ApiError, error_response
from gateway.series import Series

SESSION_COOKIE = "polymorph_session"
SESSION_TTL_S = 12 * 3600
_SESSION_CONTEXT = b"polymorph-dashboard-session-v1:"
_STATIC_TYPES = {".html": "text/html", ".js": "application/javascript", ".css": "text/css"}
_STATIC_FILES = ("dashboard.html", "dashboard.js", "dashboard.css", "login.html")  # package data (pyproject)
# Everything the page loads is its own: no inline script, no third party, no framing.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

AdminCheck = Callable[[web.Request], bool]


def token_matches(token: str, admin_token_sha256: str | None) -> bool:
    if not token or admin_token_sha256 is None:
        return False
    digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()
    return hmac.compare_digest(digest, admin_token_sha256)


def _signature(admin_token_sha256: str, expires_at_unix_s: int) -> str:
    key = _SESSION_CONTEXT + admin_token_sha256.encode("ascii", "replace")
    return hmac.new(key, str(expires_at_unix_s).encode("ascii"), hashlib.sha256).hexdigest()


def session_cookie_value(admin_token_sha256: str, expires_at_unix_s: int) -> str:
    """``<expiry>.<hmac>``: valid until the expiry, and only while the admin token stays the same."""
    return f"{expires_at_unix_s}.{_signature(admin_token_sha256, expires_at_unix_s)}"


def is_valid_session(request: web.Request, admin_token_sha256: str | None, now_unix_s: float | None = None) -> bool:
    """Whether the request carries an unexpired session cookie minted for this admin token."""
    value = request.cookies.get(SESSION_COOKIE)
    if admin_token_sha256 is None or not value or "." not in value:
        return False
    expiry, _, signature = value.partition(".")
    if not expiry.isdigit() or len(expiry) > 12:
        return False
    now = time.time() if now_unix_s is None else now_unix_s
    if int(expiry) <= now:
        return False
    return hmac.compare_digest(signature, _signature(admin_token_sha256, int(expiry)))


def is_admin_request(request: web.Request, admin_token_sha256: str | None, now_unix_s: float | None = None) -> bool:
    """``Authorization: Bearer <admin token>`` or a dashboard session cookie: a ready ``check_admin``."""
    token = bearer_token(request.headers.get("Authorization", ""))
    if token is not None and token_matches(token, admin_token_sha256):
        return True
    return is_valid_session(request, admin_token_sha256, now_unix_s)


def _see_dashboard() -> web.Response:
    return web.Response(status=303, headers={**_PAGE_HEADERS, "Location": "/dashboard"})


def _load_static() -> dict[str, tuple[bytes, str]]:
    folder = resources.files("gateway") / "static"
    return {name: (folder.joinpath(name).read_bytes(), _STATIC_TYPES[name[name.rindex(".") :]]) for name in _STATIC_FILES}


class DashboardHandlers:
    def __init__(self, series_provider: Callable[[], Series], check_admin: AdminCheck, admin_token_sha256: Callable[[], str | None], clock: Callable[[], float], session_ttl_s: float) -> None:
        self.series_provider = series_provider
        self.check_admin = check_admin
        self.admin_token_sha256 = admin_token_sha256
        self.clock = clock
        self.session_ttl_s = session_ttl_s
        self.static = _load_static()

    def _page(self, name: str, status: int = 200, message: str = "") -> web.Response:
        body, content_type = self.static[name]
        if name == "login.html":
            # A fixed message of ours, never request text: nothing to escape beyond the HTML basics.
            body = body.replace(b"{{message}}", message.replace("&", "&amp;").replace("<", "&lt;").encode())
        return web.Response(status=status, body=body, content_type=content_type, charset="utf-8", headers=_PAGE_HEADERS)

    def _login_page(self, status: int, message: str) -> web.Response:
        if self.admin_token_sha256() is None:
            return self._page("login.html", 403, "The admin API is disabled: set server.admin_token in the gateway config.")
        return self._page("login.html", status, message)

    def _signed_in(self, request: web.Request, admin_token_sha256: str) -> web.Response:
        """303 to the bare page URL (dropping any ?token=) with a fresh session cookie."""
        expires_at = int(self.clock() + self.session_ttl_s)
        response = _see_dashboard()
        value = session_cookie_value(admin_token_sha256, expires_at)
        # path=/ because the page's polls of /admin/* carry it; Secure whenever the gateway is reached over TLS.
        response.set_cookie(SESSION_COOKIE, value, max_age=int(self.session_ttl_s), path="/", httponly=True, samesite="Strict", secure=request.secure)
        return response

    async def dashboard(self, request: web.Request) -> web.StreamResponse:
        token = request.query.get("token")
        if token is not None:
            sha = self.admin_token_sha256()
            if sha is not None and token_matches(token, sha):
                return self._signed_in(request, sha)
            return self._login_page(401, "That is not the admin token.")
        if self.check_admin(request):
            return self._page("dashboard.html")
        return self._login_page(401, "")

    async def login(self, request: web.Request) -> web.StreamResponse:
        try:
            form = await request.post()
        except RequestPayloadError:  # a body its Content-Encoding does not decode (was a 500)
            return self._login_page(400, "The form could not be read.")
        token = form.get("token")
        sha = self.admin_token_sha256()
        if sha is not None and isinstance(token, str) and token_matches(token.strip(), sha):
            return self._signed_in(request, sha)
        return self._login_page(401, "That is not the admin token.")

    async def logout(self, request: web.Request) -> web.StreamResponse:
        response = _see_dashboard()
        response.del_cookie(SESSION_COOKIE, path="/")
        return response

    async def static_file(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.static or name.endswith(".html"):
            return error_response(ApiError(404, "No such dashboard file.", "unknown_endpoint"))
        return self._page(name)

    async def series(self, request: web.Request) -> web.Response:
        if not self.check_admin(request):
            return error_response(ApiError(401, "The admin API needs 'Authorization: Bearer <admin token>' or a dashboard session.", "invalid_admin_token"))
        series = self.series_provider()
        try:
            window_s = float(request.query.get("window_s", series.span_s))
        except ValueError:
            window_s = float("nan")
        if not 0 < window_s <= series.span_s:
            return error_response(ApiError(400, f"window_s must be a number of seconds in (0, {series.span_s}].", "invalid_window", "window_s"))
        body = orjson.dumps(series.snapshot(self.clock(), window_s))
        return web.Response(body=body, content_type="application/json", headers={"Cache-Control": "no-store"})


def add_dashboard_routes(
    app: web.Application,
    series_provider: Callable[[], Series],
    check_admin: AdminCheck,
    admin_token_sha256: Callable[[], str | None],
    *,
    clock: Callable[[], float] = time.time,
    session_ttl_s: float = SESSION_TTL_S,
) -> None:
    """Mount GET /dashboard, POST /dashboard/login and /dashboard/logout, GET /dashboard/static/{name}
    and GET /admin/series. Call before any catch-all route: aiohttp matches routes in the order added.

    ``admin_token_sha256`` is read on every login so that a config reload that rotates the token applies.
    """
    handlers = DashboardHandlers(series_provider, check_admin, admin_token_sha256, clock, session_ttl_s)
    router = app.router
    router.add_get("/dashboard", handlers.dashboard)
    router.add_post("/dashboard/login", handlers.login)
    router.add_post("/dashboard/logout", handlers.logout)
    router.add_get("/dashboard/static/{name}", handlers.static_file)
    router.add_get("/admin/series", handlers.series)
