"""The benchmarks that drive live processes: `polymorph bench gateway`, `peers`, `dashboard`, `loadgen`,
`adapt` and `priority` (loadtest/cli.py registers them).

`bench gateway`: every variant (direct, a minimal aiohttp pass-through, nginx, Polymorph) proxies the
same nginx backend, whose cost is fixed, while wrk (peak rate) and h2load (constant rate) drive the load.
"""
