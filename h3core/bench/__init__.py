"""Benchmarks behind `h3` commands: `transport` (`h3 bench-transport`: Ulysses' path against the wire),
and `alternate` (interleaved rounds of A and B, spreads, and speedups above the ideal flagged as
noise: `h3 matrix --repeat` and the scripts' A/B tables)."""
