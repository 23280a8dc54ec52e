#!/usr/bin/env bash
# Seed compatibility: run_distributed_t2va.sh MODE [COUNT] [ATTN] [h3 generate options...]
exec h3 generate "$@"
