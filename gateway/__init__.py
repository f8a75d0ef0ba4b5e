"""Polymorph gateway: the aiohttp front door, tenants, admission, metrics and the CLI."""
