#!/usr/bin/env python3
"""Runs scripts/reference/torch_finetune.py unchanged, recording its training losses (which it
computes but does not report): torch.nn.functional.cross_entropy is wrapped, and every call made
with grad enabled (the training steps; validation runs under no_grad) appends loss.item() to a
list, written as JSON to $TRAIN_LOSSES_OUT at exit ({"losses": [...]}: the modes in order, 3
warm-up + --steps each).

  TRAIN_LOSSES_OUT=/tmp/ct_losses.json python torch_train_losses.py scripts/reference/torch_finetune.py ARGS...
"""
import atexit, json, os, runpy, sys
import torch
import torch.nn.functional as F

_ce, losses = F.cross_entropy, []


def ce(*args, **kw):
    out = _ce(*args, **kw)
    if torch.is_grad_enabled():
        losses.append(out.item())
    return out


F.cross_entropy = ce
atexit.register(lambda: json.dump({"losses": losses}, open(os.environ["TRAIN_LOSSES_OUT"], "w")))
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
