#!/bin/bash
# the BERT engine test on CUDA with its failure message (cuBLASLt bias epilogue build)
set -u; source .gpu/c6/unpack.sh .gpu/c6
timeout 120 $B/bert --test-threads 1 cuda::engine 2>&1 | grep -v "^  *[0-9]*: \|^  *at " | tail -30
