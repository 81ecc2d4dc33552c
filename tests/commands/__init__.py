"""Tests that start a fresh process on purpose: what the CLI imports at start-up, launch.sh's own checks,
a child's peak memory, DeepSpeed's own scripts. Everything else about the commands runs in-process in
tests/unit."""
