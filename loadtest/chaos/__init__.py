"""The chaos and hostile-input suite: `polymorph bench chaos` and the fast subset under tests/chaos/."""
