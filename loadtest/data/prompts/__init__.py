"""Per-domain prompt samples; see SOURCE.md (package data)."""
