"""Shipped data: fitted length/arrival shapes and the prompt corpus (package data)."""
