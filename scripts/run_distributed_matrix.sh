#!/usr/bin/env bash
# Seed compatibility: H3_SAVE_LATENTS=0 run_distributed_matrix.sh [h3 matrix options...]
exec h3 matrix "$@"
