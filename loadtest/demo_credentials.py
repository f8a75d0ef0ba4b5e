"""The demo deployment's public credentials, defined once.

`polymorph serve` without a config (and examples/demo.yaml) admits the demo tenant with ``DEMO_API_KEY``
and the admin API with ``DEMO_ADMIN_TOKEN``; `polymorph demo`, the agreement check and the benchmarks
drive such a deployment with them. They live here, at the bottom of loadtest, so both the gateway
(which may import loadtest) and the load tools (which must not import the gateway) read one copy.
They are demo-only: a real deployment configures its own.
"""

from __future__ import annotations

DEMO_API_KEY = "sk-polymorph-demo"
DEMO_ADMIN_TOKEN = "polymorph-admin-demo"
