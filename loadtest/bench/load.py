"""wrk as the load generator: closed-loop peak rate, and an open, constant-rate mode for latency.

Debian's wrk has no ``-R`` (that is wrk2, which Debian does not package), so the constant-rate mode
is a Lua ``delay()`` that hands each ready connection the next free slot of a fixed schedule,
read from ``clock_gettime`` through LuaJIT's ffi. wrk's timers tick in whole milliseconds, so at a
few thousand requests/s a handful of sends share a tick; latency is timed from the actual send.
"""

from __future__ import annotations

import math
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from loadtest.bench.processes import pinned
from loadtest.demo_credentials import DEMO_API_KEY

_RESULT_LINE = re.compile(r"^BENCH_RESULT (.+)$", re.MULTILINE)

_SCRIPT_HEAD = """\
wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {api_key}"

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("BENCH_RESULT %d %d %d %d %d %d %d %.0f %.0f\\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""

_PACING = """\
local ffi = require("ffi")
ffi.cdef[[
typedef struct {{ long tv_sec; long tv_nsec; }} bench_timespec;
int clock_gettime(int clk_id, bench_timespec *tp);
]]
local clock = ffi.new("bench_timespec")
local CLOCK_MONOTONIC = 1
local interval_ms = {interval_ms!r}
local next_slot_ms = nil

local function now_ms()
  ffi.C.clock_gettime(CLOCK_MONOTONIC, clock)
  return tonumber(clock.tv_sec) * 1000 + tonumber(clock.tv_nsec) / 1e6
end

-- Slots missed while every connection was busy are dropped, not caught up in a burst: the
-- achieved rate then falls short and the report shows it.
function delay()
  local now = now_ms()
  if next_slot_ms == nil or next_slot_ms < now then next_slot_ms = now end
  local wait_ms = next_slot_ms - now
  next_slot_ms = next_slot_ms + interval_ms
  return math.floor(wait_ms + 0.5)
end
"""


@dataclass(frozen=True, slots=True)
class WrkResult:
    """One wrk run: counts, elapsed time and latency percentiles."""

    num_requests: int
    duration_s: float
    num_socket_errors: int
    num_bad_status: int
    p50_ms: float
    p99_ms: float

    @property
    def rps(self) -> float:
        """Successful requests per second: fast error answers must not inflate a peak."""
        num_ok = self.num_requests - self.num_bad_status
        return num_ok / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def num_errors(self) -> int:
        return self.num_socket_errors + self.num_bad_status


def write_script(path: Path, body: bytes, rate_rps: float | None) -> Path:
    """A wrk Lua script POSTing ``body``; paced to ``rate_rps`` in total when given."""
    text = _SCRIPT_HEAD.format(body=body.decode(), api_key=DEMO_API_KEY)
    if rate_rps is not None:
        text += _PACING.format(interval_ms=1000.0 / rate_rps)
    path.write_text(text)
    return path


def connections_for_rate(rate_rps: float) -> int:
    """Enough connections that each sends about every 10 ms, so none is busy when its slot comes."""
    return max(8, math.ceil(rate_rps / 100))


def wrk_argv(
    wrk: str, url: str, script: Path, num_connections: int, duration_s: float, cpus: str | None
) -> list[str]:
    argv = [
        wrk, "-t1", f"-c{num_connections}", f"-d{max(1, round(duration_s))}s", "--timeout", "5s",
        "-s", str(script), url,
    ]
    return pinned(argv, cpus)


def run_wrk(wrk: str, url: str, script: Path, num_connections: int, duration_s: float, cpus: str | None) -> WrkResult:
    """Run wrk in the foreground and parse the line its ``done()`` prints."""
    argv = wrk_argv(wrk, url, script, num_connections, duration_s, cpus)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60, check=False)
    return parse_wrk_output(done.stdout, done.stderr)


def parse_wrk_output(stdout: str, stderr: str = "") -> WrkResult:
    match = _RESULT_LINE.search(stdout)
    if match is None:
        raise RuntimeError(f"wrk printed no result: {(stdout + stderr).strip()[-800:]}")
    requests, duration_us, connect, read, write, status, timeout, p50_us, p99_us = (
        int(float(field)) for field in match.group(1).split()
    )
    return WrkResult(
        num_requests=requests,
        duration_s=duration_us / 1e6,
        num_socket_errors=connect + read + write + timeout,
        num_bad_status=status,
        p50_ms=p50_us / 1000,
        p99_ms=p99_us / 1000,
    )
