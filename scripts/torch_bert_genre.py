#!/usr/bin/env python3
"""PyTorch reference run for examples/finetune_bert.rs: fine-tune all-MiniLM-L6-v2 to tell which
genre of Shakespeare play a line comes from, on exactly the batches wick trained and tested on.

Usage:
    python3 scripts/torch_bert_genre.py --model data/minilm --batches batches.json \
        [--mode eager|compile|both] [--device cuda] [--warmup-steps 20] \
        [--compile-shapes dynamic|static] [--losses-out losses.json] [--checkpointing]

The batches file is the one the wick example writes: "classes", "pad_id", "config" (batch_size,
lr, head_lr, weight_decay, warmup, total_steps, clip, beta1, beta2, eps, precision) and the lists
"train" (one entry per optimizer step, in step order) and "test", each entry holding "ids" (rows
already padded with pad_id to the batch's padded length), "lengths" (real tokens per row, [CLS] and
[SEP] included) and "labels".

What has to match the wick example, so that both runs start identical and see the same data:
  * the encoder is BertModel with dropout 0 and no pooler, attention "sdpa"; attention_mask is
    (position < length), token_type_ids are all 0, position ids 0..T-1;
  * the sentence vector is the mean of last_hidden_state over the valid positions (sum / length,
    computed in fp32, no L2 normalisation), and the head is Linear(hidden, n_classes) with weight
    and bias both initialised to zero;
  * the loss is the batch mean of cross-entropy; bf16-mixed means torch.autocast(bf16) around
    forward + loss with fp32 master weights ("32"/"fp32" run plain fp32, others are refused);
  * AdamW (decoupled weight decay) with groups: head at head_lr, encoder at lr; weight decay for
    parameters with ndim >= 2 (embeddings, linear weights, head weight), none for ndim 1 (biases,
    LayerNorm); every lr is scaled by f(s) for 0-based step s: (s+1)/warmup during warmup, then a
    linear decay 1 - (s-warmup)/(total_steps-warmup), 0 from total_steps on;
  * clip_grad_norm_(all parameters, clip) before every step; one step per train entry.

Timing: all batches are copied to the device before the clock starts, so the loop measures the
model, not host-to-device copies. The steady-state rate covers the train steps after the first
--warmup-steps (device synchronised at both ends, the loop timed as a whole). In compile mode every
distinct input shape is compiled first, by forward + backward passes whose gradients are thrown
away (no optimizer step, nothing random, so training is unchanged); that time is reported as
compile_s and is part of the total train wall time, and the timed loop then runs without
recompiles (graphs_compiled_in_timed_loops counts any that happen anyway). --compile-shapes
dynamic (the default) marks the batch and sequence dimensions dynamic, so one graph for training and
one for evaluation serve every padded length; static (dynamic=False) compiles one graph per shape.
compile_s depends on whether inductor's on-disk cache is warm (a second run compiles much faster).
Peak memory is torch.cuda.max_memory_allocated over the whole mode (train + test), in GiB.

--checkpointing turns on transformers' per-layer activation checkpointing
(model.encoder.gradient_checkpointing_enable), the configuration of the wick example's
--checkpointing layer: each BertLayer keeps only its input and is recomputed in the backward.
(The wick example's default, --checkpointing attention, recomputes each layer's attention
sub-block only; transformers has no such switch, so a default run of each compares that with
PyTorch keeping every activation, and --checkpointing here with --checkpointing layer there is
the like-for-like pair.) It uses
torch.utils.checkpoint with use_reentrant=False, PyTorch's recommended variant: dynamo traces it
(no graph break per layer under torch.compile), it does not need the layer's input to require
grad, and it recomputes a layer when the backward first needs one of its saved tensors. Either
variant keeps each layer's input; wick's wick::recompute follows the reentrant one (the whole
layer is re-run, then backpropagated). Checkpointing acts in training only (transformers checks
module.training), so evaluation is unchanged, and the losses equal those without it up to the
GPU kernels' own run-to-run differences (no dropout: the recomputation is the same forward).

Macro-F1 is the mean over all n_classes of per-class F1 = 2TP / (2TP + FP + FN); a class that has
neither predictions nor labels in the test set gets F1 = 0 (sklearn's zero_division=0) and still
counts in the mean.
"""
import argparse, json, math, platform, sys, time

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers import BertModel


class GenreClassifier(nn.Module):
    """BERT encoder, masked mean pooling, linear head (zero-initialised)."""

    def __init__(self, model_dir, n_classes):
        super().__init__()
        self.encoder = BertModel.from_pretrained(
            model_dir, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            add_pooling_layer=False, attn_implementation="sdpa")
        self.head = nn.Linear(self.encoder.config.hidden_size, n_classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids, mask, lengths):
        hidden = self.encoder(input_ids=ids, attention_mask=mask,
                              token_type_ids=torch.zeros_like(ids)).last_hidden_state
        summed = (hidden.float() * mask.unsqueeze(-1).float()).sum(dim=1)
        pooled = summed / lengths.unsqueeze(-1).float()
        return self.head(pooled)


def lr_factor(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    if step < total:
        return 1.0 - (step - warmup) / (total - warmup)
    return 0.0


def make_optimizer(model, cfg, device):
    groups = []
    for part, lr in ((model.head, cfg["head_lr"]), (model.encoder, cfg["lr"])):
        params = [p for p in part.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        groups.append({"params": decay, "lr": lr, "weight_decay": cfg["weight_decay"]})
        groups.append({"params": no_decay, "lr": lr, "weight_decay": 0.0})
    extra = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(groups, betas=(cfg["beta1"], cfg["beta2"]), eps=cfg["eps"], **extra)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg["warmup"], cfg["total_steps"]))
    return opt, sched


def to_device(entries, device, pad_id):
    """Each batch as (ids, mask, lengths, labels) tensors on the device; checks the padding."""
    out = []
    for i, b in enumerate(entries):
        ids = torch.tensor(b["ids"], dtype=torch.long)
        lengths = torch.tensor(b["lengths"], dtype=torch.long)
        labels = torch.tensor(b["labels"], dtype=torch.long)
        n, t = ids.shape
        assert lengths.shape == (n,) and labels.shape == (n,), f"batch {i}: shapes disagree"
        mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
        assert bool((ids[~mask] == pad_id).all()), f"batch {i}: non-pad id past a row's length"
        assert int(lengths.min()) >= 2 and int(lengths.max()) <= t, f"batch {i}: bad lengths"
        out.append(tuple(x.to(device) for x in (ids, mask.long(), lengths, labels)))
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def evaluate(fn, batches, n_classes, autocast):
    """Accuracy, macro-F1 and the mean test loss; predictions gathered on the device."""
    preds, labels, losses = [], [], []
    with torch.no_grad(), autocast():
        for ids, mask, lengths, y in batches:
            logits = fn(ids, mask, lengths)
            losses.append(F.cross_entropy(logits.float(), y, reduction="sum"))
            preds.append(logits.argmax(dim=-1))
            labels.append(y)
    pred, lab = torch.cat(preds).cpu(), torch.cat(labels).cpu()
    f1s = []
    for c in range(n_classes):
        tp = int(((pred == c) & (lab == c)).sum())
        fp = int(((pred == c) & (lab != c)).sum())
        fn_ = int(((pred != c) & (lab == c)).sum())
        f1s.append(2 * tp / (2 * tp + fp + fn_) if tp + fp + fn_ > 0 else 0.0)
    return {"test_accuracy": float((pred == lab).float().mean()),
            "test_macro_f1": sum(f1s) / n_classes, "test_per_class_f1": f1s,
            "test_loss": float(torch.stack(losses).sum()) / len(lab), "test_examples": len(lab)}


def run_mode(mode, args, data, device):
    cfg = data["config"]
    n_classes = len(data["classes"])
    precision = cfg.get("precision", "bf16-mixed")
    assert precision in ("bf16-mixed", "bf16", "32", "fp32", "f32"), (
        f"precision {precision!r}: this reference runs bf16-mixed or fp32 only")
    bf16 = precision.startswith("bf16")
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    train = to_device(data["train"], device, data["pad_id"])
    test = to_device(data["test"], device, data["pad_id"])

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)  # nothing is random (zero head, no dropout); set for good measure
    model = GenreClassifier(args.model, n_classes).to(device)
    if args.checkpointing:
        model.encoder.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    attn = model.encoder.config._attn_implementation
    opt, sched = make_optimizer(model, cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]

    fn, compile_s, n_shapes = model, 0.0, 0
    graphs = lambda: 0
    if mode == "compile":
        import torch._dynamo as dynamo
        from torch._dynamo.utils import counters
        base = counters["stats"]["unique_graphs"]
        graphs = lambda: counters["stats"]["unique_graphs"] - base  # graphs this mode compiled
        for knob in ("recompile_limit", "cache_size_limit"):  # room for one graph per shape
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, max(getattr(dynamo.config, knob), 256))
        fn = torch.compile(model, dynamic=False if args.compile_shapes == "static" else None)
        if args.compile_shapes == "dynamic":
            for ids, mask, lengths, _ in train + test:
                for x in (ids, mask, lengths):
                    for dim in range(x.ndim):
                        if x.shape[dim] > 1:  # sizes 0 and 1 are always specialised
                            dynamo.maybe_mark_dynamic(x, dim)
        # Compile every distinct shape up front; the gradients are discarded, nothing changes.
        sync(device)
        t0 = time.perf_counter()
        seen_train, seen_test = {}, {}
        for b in train:
            seen_train.setdefault(tuple(b[0].shape), b)
        for b in test:
            seen_test.setdefault(tuple(b[0].shape), b)
        for ids, mask, lengths, y in seen_train.values():
            with autocast():
                loss = F.cross_entropy(fn(ids, mask, lengths).float(), y)
            loss.backward()
            opt.zero_grad(set_to_none=True)
        model.eval()  # the training flag is guarded on: compile the test graphs in eval mode
        with torch.no_grad(), autocast():
            for ids, mask, lengths, _ in seen_test.values():
                fn(ids, mask, lengths)
        model.train()
        sync(device)
        compile_s = time.perf_counter() - t0
        n_shapes = len(seen_train) + len(seen_test)
    graphs_compiled = graphs()

    # LambdaLR has already applied f(0); check it, then check each step's lr against f(s).
    warm = min(args.warmup_steps, max(len(train) - 1, 0))
    if warm < args.warmup_steps:
        print(f"note: only {len(train)} train steps; the steady rate skips {warm}", file=sys.stderr)
    losses = []
    sync(device)
    t_start = time.perf_counter()
    t_steady = t_start
    for step, (ids, mask, lengths, y) in enumerate(train):
        if step == warm:
            sync(device)
            t_steady = time.perf_counter()
        want = cfg["head_lr"] * lr_factor(step, cfg["warmup"], cfg["total_steps"])
        assert math.isclose(opt.param_groups[0]["lr"], want, rel_tol=1e-9, abs_tol=1e-15), (
            f"step {step}: head lr {opt.param_groups[0]['lr']} != {want}")
        with autocast():
            loss = F.cross_entropy(fn(ids, mask, lengths).float(), y)
        loss.backward()
        if cfg.get("clip", 0) > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg["clip"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync(device)
    t_end = time.perf_counter()
    losses = torch.stack(losses).float().cpu().tolist()
    steady_examples = sum(b[0].shape[0] for b in train[warm:])

    model.eval()
    sync(device)
    t0 = time.perf_counter()
    result = evaluate(fn, test, n_classes, autocast)
    sync(device)
    test_s = time.perf_counter() - t0
    graphs_in_timed = graphs() - graphs_compiled  # recompiles inside the timed loops (want 0)

    tail = losses[-50:]
    result = {
        "mode": mode, "attn_implementation": attn, "precision": "bf16-mixed" if bf16 else "fp32",
        "checkpointing": args.checkpointing,
        "compile_shapes": args.compile_shapes if mode == "compile" else None,
        "distinct_shapes": n_shapes, "graphs_compiled": graphs_compiled,
        "graphs_compiled_in_timed_loops": graphs_in_timed, "train_steps": len(train),
        "train_examples": sum(b[0].shape[0] for b in train), "warmup_steps_excluded": warm,
        "steady_examples_per_s": steady_examples / max(t_end - t_steady, 1e-12),
        "compile_s": compile_s, "train_loop_s": t_end - t_start,
        "train_wall_s": compile_s + (t_end - t_start),
        "first_loss": losses[0] if losses else None,
        "final_train_loss": sum(tail) / len(tail) if tail else None,
        **result, "test_s": test_s, "test_examples_per_s": result["test_examples"] / test_s,
        "peak_mem_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                        if device.type == "cuda" else None),
    }
    del fn, model, opt, sched
    if mode == "compile":
        torch._dynamo.reset()
    return result, losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="data/minilm")
    ap.add_argument("--batches", required=True)
    ap.add_argument("--mode", choices=["eager", "compile", "both"], default="both")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--compile-shapes", choices=["dynamic", "static"], default="dynamic")
    ap.add_argument("--losses-out", help="write every mode's per-step train losses here (JSON)")
    ap.add_argument("--checkpointing", action="store_true",
                    help="per-layer activation checkpointing (gradient_checkpointing_enable, "
                         "use_reentrant=False)")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()  # the unused pooler weights are expected
    transformers.logging.disable_progress_bar()

    with open(args.batches) as f:
        data = json.load(f)
    cfg = data["config"]
    if len(data["train"]) != cfg["total_steps"]:
        print(f"note: {len(data['train'])} train batches, config total_steps {cfg['total_steps']}",
              file=sys.stderr)
    device = torch.device(args.device)
    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                      else f"cpu ({platform.processor() or platform.machine()})"),
           "python": platform.python_version()}
    print(f"torch {env['torch']}, transformers {env['transformers']}, {env['device']}; "
          f"{len(data['train'])} train / {len(data['test'])} test batches, "
          f"{len(data['classes'])} classes, config {json.dumps(cfg)}")

    modes = ["eager", "compile"] if args.mode == "both" else [args.mode]
    results, all_losses = [], {}
    for mode in modes:
        r, losses = run_mode(mode, args, data, device)
        r.update(env)
        results.append(r)
        all_losses[mode] = losses

    cols = [("mode", "mode", "{}"), ("attn", "attn_implementation", "{}"),
            ("steady ex/s", "steady_examples_per_s", "{:.1f}"), ("compile s", "compile_s", "{:.1f}"),
            ("train wall s", "train_wall_s", "{:.1f}"), ("peak GiB", "peak_mem_gib", "{:.3f}"),
            ("first loss", "first_loss", "{:.4f}"), ("final loss", "final_train_loss", "{:.4f}"),
            ("test acc", "test_accuracy", "{:.4f}"), ("macro-F1", "test_macro_f1", "{:.4f}"),
            ("test ex/s", "test_examples_per_s", "{:.1f}")]
    cells = [[h for h, _, _ in cols]] + [
        [fmt.format(r[k]) if r[k] is not None else "-" for _, k, fmt in cols] for r in results]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for j, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    for r in results:
        print("RESULT " + json.dumps(r))
    if args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump(all_losses, f)


if __name__ == "__main__":
    main()
