"""Built-in scenario files (package data)."""
