#!/usr/bin/env bash
# Seed compatibility: run_ulysses_benchmark.sh [COUNT] [ATTN] [h3 bench-transport options...]
exec h3 bench-transport "$@"
