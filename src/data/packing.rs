//! Training batches of tokenized chat examples: packed without padding, or padded.
//!
//! **Packed** ([`TrainBatch::packed`]): the examples of a step are laid end to end in one row
//! `(1, N)`, `N` their total length, with FlashAttention's variable-length offsets
//! (`cu_seqlens = [0, n0, n0 + n1, ..., N]`, [`crate::ops::Segments`]): attention stays inside
//! each example and RoPE positions restart at 0 in each (Hugging Face's padding-free
//! `DataCollatorWithFlattening`, torchtune's packed data sets). No token is padding.
//!
//! **Padded** ([`TrainBatch::padded`]): a `(B, T)` batch, `T` the longest example, shorter ones
//! padded at the end. Under causal attention a token never sees the padding after it, so the
//! per-example losses and gradients equal the packed ones (`tests/packing.rs`).
//!
//! Either way the loss reads only the trained targets: for each example and each position `k`
//! whose next label `labels[k + 1]` is not [`IGNORE_INDEX`], row `k` of the hidden states
//! predicts it. Those rows' indices (into the flattened `(B * T)` stream) and targets are built
//! here on the host, once per batch, and uploaded with the ids; the model gathers the rows
//! before its head ([`crate::models::Decoder::batch_loss`]), so untrained positions cost no head
//! GEMM at all.
//!
//! [`pack`] groups examples into steps by a token budget, in the order given (an epoch's
//! shuffled order, [`super::chat::epoch_order`]), greedily: an example starts a new step when
//! it would overflow the current one. The order of examples is kept, so the same seed gives the
//! same steps.

use crate::ops::Segments;
use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use std::sync::Arc;

/// The label of positions that are not trained (transformers' and PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// One tokenized example.
#[derive(Debug, Clone, PartialEq)]
pub struct Tokenized {
    /// Token ids of the rendered conversation, length `T`.
    pub ids: Vec<u32>,
    /// Length `T`: `ids[k]` as i64 where trained, [`IGNORE_INDEX`] elsewhere (not shifted).
    pub labels: Vec<i64>,
    /// Assistant-span boundaries where the prefix's tokens were not a prefix of the whole's
    /// (see `data::chat`'s module docs); 0 for a well-behaved template and data.
    pub merged_boundaries: usize,
}

impl Tokenized {
    /// Targets the shifted loss reads: labels at positions `1..` other than [`IGNORE_INDEX`].
    pub fn trained_targets(&self) -> usize {
        self.labels
            .iter()
            .skip(1)
            .filter(|&&l| l != IGNORE_INDEX)
            .count()
    }
}

/// Groups the examples of `order` (indices into `lengths`, the examples' token counts) into
/// steps of at most `budget` tokens each, greedily in that order (see the module docs).
///
/// Errors: `budget == 0`; an index outside `lengths`; an example longer than the budget (naming
/// it: raise the budget or lower the maximum length); an empty example.
pub fn pack(lengths: &[usize], order: &[usize], budget: usize) -> Result<Vec<Vec<usize>>> {
    ensure!(
        budget > 0,
        "packing budget 0: give at least one token per step"
    );
    let mut steps = Vec::new();
    let (mut cur, mut used) = (Vec::new(), 0usize);
    for &i in order {
        let Some(&n) = lengths.get(i) else {
            bail!(
                "pack: example index {i} is outside the {} examples",
                lengths.len()
            )
        };
        ensure!(n > 0, "pack: example {i} has no tokens");
        ensure!(
            n <= budget,
            "pack: example {i} has {n} tokens, more than the packing budget of {budget}; raise \
             the budget (tokens per step) or lower the maximum example length"
        );
        if used + n > budget {
            steps.push(std::mem::take(&mut cur));
            used = 0;
        }
        cur.push(i);
        used += n;
    }
    if !cur.is_empty() {
        steps.push(cur);
    }
    Ok(steps)
}

/// Writes the examples of each step, one JSON line per step (`{"ids": [[...], ...], "labels":
/// [[...], ...]}`, labels unshifted with [`IGNORE_INDEX`]), so that another trainer
/// (`scripts/reference/torch_chat_sft.py`) runs the very same steps. Written to a temporary
/// file and renamed (atomic).
///
/// Errors: an index outside `examples`; a failing write (naming the path).
pub fn write_steps_jsonl(
    path: &std::path::Path,
    steps: &[Vec<usize>],
    examples: &[Tokenized],
) -> Result<()> {
    use std::io::Write;
    if let Some(i) = steps.iter().flatten().find(|&&i| i >= examples.len()) {
        bail!(
            "write_steps_jsonl: example index {i} is outside the {} examples",
            examples.len()
        )
    }
    let tmp = path.with_extension("jsonl.tmp");
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
    );
    for step in steps {
        let ids: Vec<&Vec<u32>> = step.iter().map(|&i| &examples[i].ids).collect();
        let labels: Vec<&Vec<i64>> = step.iter().map(|&i| &examples[i].labels).collect();
        let line = serde_json::json!({ "ids": ids, "labels": labels });
        writeln!(f, "{line}").with_context(|| format!("writing {}", tmp.display()))?;
    }
    f.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// How a [`TrainBatch`] lays out its examples.
#[derive(Debug)]
pub enum Layout {
    /// One row of the examples end to end, their boundaries.
    Packed(Arc<Segments>),
    /// `(B, T)` rows padded at the end; each row is one example.
    Padded,
}

/// One micro-batch of tokenized examples on a device, ready for
/// [`crate::models::CausalLm::batch_loss`].
#[derive(Debug)]
pub struct TrainBatch {
    ids: Tensor,
    rows: Tensor,
    targets: Tensor,
    layout: Layout,
    examples: usize,
    tokens: usize,
    trained: usize,
}

impl TrainBatch {
    /// The examples end to end in one row `(1, N)` (see the module docs).
    ///
    /// Errors: no examples, an empty example, labels of another length than the ids, a label
    /// that is neither [`IGNORE_INDEX`] nor a u32 id; a failing upload.
    pub fn packed(examples: &[&Tokenized], device: &Device) -> Result<Self> {
        ensure!(!examples.is_empty(), "TrainBatch::packed: no examples");
        let (mut ids, mut rows, mut targets) = (Vec::new(), Vec::new(), Vec::new());
        let mut cu = vec![0usize];
        for (e, ex) in examples.iter().enumerate() {
            check(e, ex)?;
            collect_targets(e, ex, ids.len(), &mut rows, &mut targets)?;
            ids.extend_from_slice(&ex.ids);
            cu.push(ids.len());
        }
        let n = ids.len();
        let segments = Arc::new(Segments::new(&cu, device)?);
        Self::upload(
            ids,
            (1, n),
            rows,
            targets,
            Layout::Packed(segments),
            examples,
            device,
        )
    }

    /// The examples as rows of a `(B, T)` batch, `T` the longest, padded at the end with id 0
    /// (see the module docs). Errors: as [`TrainBatch::packed`].
    pub fn padded(examples: &[&Tokenized], device: &Device) -> Result<Self> {
        ensure!(!examples.is_empty(), "TrainBatch::padded: no examples");
        let t = examples.iter().map(|e| e.ids.len()).max().unwrap_or(0);
        let (mut ids, mut rows, mut targets) = (Vec::new(), Vec::new(), Vec::new());
        for (e, ex) in examples.iter().enumerate() {
            check(e, ex)?;
            collect_targets(e, ex, e * t, &mut rows, &mut targets)?;
            ids.extend_from_slice(&ex.ids);
            ids.resize((e + 1) * t, 0);
        }
        let shape = (examples.len(), t);
        Self::upload(ids, shape, rows, targets, Layout::Padded, examples, device)
    }

    fn upload(
        ids: Vec<u32>,
        shape: (usize, usize),
        rows: Vec<u32>,
        targets: Vec<u32>,
        layout: Layout,
        examples: &[&Tokenized],
        device: &Device,
    ) -> Result<Self> {
        let trained = rows.len();
        Ok(Self {
            ids: Tensor::from_vec(ids, shape, device)?,
            rows: Tensor::from_vec(rows, trained, device)?,
            targets: Tensor::from_vec(targets, trained, device)?,
            layout,
            examples: examples.len(),
            tokens: examples.iter().map(|e| e.ids.len()).sum(),
            trained,
        })
    }

    /// Token ids, u32: `(1, N)` packed or `(B, T)` padded (padding id 0).
    pub fn ids(&self) -> &Tensor {
        &self.ids
    }

    /// `(R,)` u32: indices into the flattened `(B * T)` positions of the rows whose next token
    /// is trained.
    pub fn rows(&self) -> &Tensor {
        &self.rows
    }

    /// `(R,)` u32: the trained target of each of those rows.
    pub fn targets(&self) -> &Tensor {
        &self.targets
    }

    /// Packed with its segments, or padded.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Examples in the batch.
    pub fn examples(&self) -> usize {
        self.examples
    }

    /// Real (non-padding) tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Trained targets (the loss's denominator and the micro-batch's weight, as transformers'
    /// `num_items_in_batch`).
    pub fn trained_targets(&self) -> usize {
        self.trained
    }

    /// The segments of a packed batch; `None` padded.
    pub fn segments(&self) -> Option<&Segments> {
        self.shared_segments_ref().map(|s| &**s)
    }

    /// [`TrainBatch::segments`], shared (for recomputed blocks that outlive the borrow).
    pub fn shared_segments(&self) -> Option<Arc<Segments>> {
        self.shared_segments_ref().cloned()
    }

    fn shared_segments_ref(&self) -> Option<&Arc<Segments>> {
        match &self.layout {
            Layout::Packed(s) => Some(s),
            Layout::Padded => None,
        }
    }
}

fn check(e: usize, ex: &Tokenized) -> Result<()> {
    ensure!(!ex.ids.is_empty(), "example {e} of the batch has no tokens");
    ensure!(
        ex.labels.len() == ex.ids.len(),
        "example {e} of the batch has {} labels for {} ids; they must align",
        ex.labels.len(),
        ex.ids.len()
    );
    Ok(())
}

/// Appends the rows (offset by `base`) and targets of the trained next-token predictions of
/// `ex`, example `e` of the batch.
fn collect_targets(
    e: usize,
    ex: &Tokenized,
    base: usize,
    rows: &mut Vec<u32>,
    targets: &mut Vec<u32>,
) -> Result<()> {
    for (k, &l) in ex.labels.iter().enumerate().skip(1) {
        if l == IGNORE_INDEX {
            continue;
        }
        let Ok(t) = u32::try_from(l) else {
            bail!(
                "example {e} of the batch: label {l} at position {k} is neither {IGNORE_INDEX} \
                 nor a token id"
            )
        };
        let Ok(row) = u32::try_from(base + k - 1) else {
            bail!("example {e} of the batch: the batch exceeds 2^32 positions; use fewer examples")
        };
        rows.push(row);
        targets.push(t);
    }
    Ok(())
}
