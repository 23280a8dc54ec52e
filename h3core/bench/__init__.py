"""Benchmarks behind `h3` commands: `transport` (`h3 bench-transport`: Ulysses' path against the wire)."""
