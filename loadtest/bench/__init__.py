"""`polymorph bench gateway`: the gateway's request rate and added latency, side by side.

Every variant (direct, a minimal aiohttp pass-through, nginx, Polymorph) proxies the same nginx
backend, whose cost is fixed, while wrk (peak rate) and h2load (constant rate) drive the load.
"""
