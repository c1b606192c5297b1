#!/bin/bash
# the second call on the same machine: PyTorch's train steps, eager and torch.compile
source .gpu/device-env.sh > /dev/null 2>&1
{ echo "== eager"; timeout 240 python3 .gpu/torch_reference.py step; echo "== compile"; timeout 330 python3 .gpu/torch_reference.py step --compile; } > $OUT/torch_step.txt 2>&1
