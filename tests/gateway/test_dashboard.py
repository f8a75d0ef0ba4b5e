"""The dashboard's routes over real HTTP on loopback: login, session cookie, static files, /admin/series."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from gateway.dashboard import SESSION_COOKIE, add_dashboard_routes, is_admin_request, is_valid_session, session_cookie_value
from gateway.series import Series

TOKEN = "dashboard-admin-token"
SHA = hashlib.sha256(TOKEN.encode()).hexdigest()
NOW = 1_800_000_000.0


def _request(cookie: str | None = None, bearer: str | None = None) -> web.Request:
    headers = {}
    if cookie is not None:
        headers["Cookie"] = f"{SESSION_COOKIE}={cookie}"
    if bearer is not None:
        headers["Authorization"] = f"Bearer {bearer}"
    return make_mocked_request("GET", "/admin/series", headers=headers)


def test_session_cookie_is_valid_until_expiry_and_only_for_its_token() -> None:
    value = session_cookie_value(SHA, int(NOW) + 60)
    assert is_valid_session(_request(value), SHA, NOW)
    assert not is_valid_session(_request(value), SHA, NOW + 60)  # expired
    assert not is_valid_session(_request(value), hashlib.sha256(b"rotated-token").hexdigest(), NOW)
    expiry, _, signature = value.partition(".")
    assert not is_valid_session(_request(f"{int(expiry) + 3600}.{signature}"), SHA, NOW)  # extended by hand
    assert not is_valid_session(_request(f"{expiry}.{'0' * 64}"), SHA, NOW)
    for junk in ("", ".", "abc.def", "1e99.x", f"{'9' * 40}.{signature}"):
        assert not is_valid_session(_request(junk), SHA, NOW)
    assert not is_valid_session(_request(value), None, NOW)  # admin API disabled
    assert TOKEN not in value and SHA not in value


def test_admin_request_takes_the_bearer_token_or_a_session() -> None:
    assert is_admin_request(_request(bearer=TOKEN), SHA, NOW)
    assert not is_admin_request(_request(bearer="wrong"), SHA, NOW)
    assert is_admin_request(_request(cookie=session_cookie_value(SHA, int(NOW) + 5)), SHA, NOW)
    assert not is_admin_request(_request(), SHA, NOW)
    assert not is_admin_request(_request(bearer=TOKEN), None, NOW)


def _serve(check: Callable[[TestClient, Series], Awaitable[None]], admin_sha: str | None = SHA) -> None:
    series = Series(step_s=10, span_s=600)
    series.record(NOW - 15, "short-chat", "interactive", "chat", ok=True, met_slo=True, ttft_s=0.25, tpot_s=0.02)

    async def main() -> None:
        app = web.Application()
        add_dashboard_routes(app, lambda: series, lambda r: is_admin_request(r, admin_sha, NOW), lambda: admin_sha, clock=lambda: NOW, session_ttl_s=3600)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            await check(client, series)

    asyncio.run(main())


def test_without_a_session_the_page_is_the_login_form_and_the_series_refused() -> None:
    async def check(client: TestClient, series: Series) -> None:
        page = await client.get("/dashboard")
        assert page.status == 401
        assert 'action="/dashboard/login"' in await page.text()
        assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
        refused = await client.get("/admin/series")
        assert refused.status == 401
        assert (await refused.json())["error"]["code"] == "invalid_admin_token"

    _serve(check)


def test_a_wrong_token_is_refused_and_never_echoed() -> None:
    async def check(client: TestClient, series: Series) -> None:
        for response in (await client.get("/dashboard", params={"token": "guess-one"}), await client.post("/dashboard/login", data={"token": "guess-two"})):
            assert response.status == 401
            body = await response.text()
            assert "That is not the admin token." in body
            assert "guess-" not in body
            assert SESSION_COOKIE not in response.headers.get("Set-Cookie", "")
        assert len(client.session.cookie_jar) == 0
        assert (await client.get("/admin/series")).status == 401

    _serve(check)


def test_the_token_in_the_url_signs_in_once_and_redirects_it_away() -> None:
    async def check(client: TestClient, series: Series) -> None:
        response = await client.get("/dashboard", params={"token": TOKEN}, allow_redirects=False)
        assert response.status == 303
        assert response.headers["Location"] == "/dashboard"
        cookie = response.cookies[SESSION_COOKIE]
        assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/"
        assert cookie["max-age"] == "3600"
        assert cookie.value == session_cookie_value(SHA, int(NOW) + 3600)
        page = await client.get("/dashboard")  # the client's jar now holds the session
        assert page.status == 200
        assert '<script src="/dashboard/static/dashboard.js"' in await page.text()
        series_response = await client.get("/admin/series", params={"window_s": "60"})
        assert series_response.status == 200
        assert orjson.loads(await series_response.read()) == series.snapshot(NOW, 60)

    _serve(check)


def test_the_login_form_signs_in_and_logout_ends_the_session() -> None:
    async def check(client: TestClient, series: Series) -> None:
        response = await client.post("/dashboard/login", data={"token": f"  {TOKEN}\n"}, allow_redirects=False)
        assert response.status == 303
        assert (await client.get("/dashboard")).status == 200
        response = await client.post("/dashboard/logout", allow_redirects=False)
        assert response.status == 303
        assert (await client.get("/dashboard")).status == 401

    _serve(check)


def test_series_takes_the_bearer_token_and_checks_the_window() -> None:
    async def check(client: TestClient, series: Series) -> None:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        body = await (await client.get("/admin/series", headers=auth)).json()
        assert body["step_s"] == 10 and len(body["t"]) == 60  # the whole span by default
        assert body["mix"]["short-chat"][-2:] == [0.1, 0.0]
        for bad in ("0", "-5", "601", "nan", "soon"):
            response = await client.get("/admin/series", params={"window_s": bad}, headers=auth)
            assert response.status == 400, bad
            assert (await response.json())["error"]["param"] == "window_s"

    _serve(check)


def test_static_files_are_served_with_their_types_and_nothing_else() -> None:
    async def check(client: TestClient, series: Series) -> None:
        js = await client.get("/dashboard/static/dashboard.js")
        assert js.status == 200 and js.content_type == "application/javascript"
        assert "setTimeout(loop, POLL_MS)" in await js.text()
        css = await client.get("/dashboard/static/dashboard.css")
        assert css.status == 200 and css.content_type == "text/css"
        for name in ("dashboard.html", "login.html", "..%2Fdashboard.py", "nope.js"):
            assert (await client.get(f"/dashboard/static/{name}")).status == 404, name

    _serve(check)


def test_with_the_admin_api_disabled_the_page_says_so() -> None:
    async def check(client: TestClient, series: Series) -> None:
        response = await client.get("/dashboard")
        assert response.status == 403
        assert "admin API is disabled" in await response.text()
        assert (await client.post("/dashboard/login", data={"token": TOKEN})).status == 403

    _serve(check, admin_sha=None)
