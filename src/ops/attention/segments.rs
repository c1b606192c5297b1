//! Document boundaries of a packed row: several documents concatenated in one `(1, N)` row, as
//! FlashAttention's variable-length API describes them (`flash_attn_varlen_func`'s
//! `cu_seqlens`: the cumulative offsets `[0, n0, n0 + n1, ..., N]`). Query `i` of document `d`
//! attends to keys `j` with `start(d) <= j <= i` ([`crate::ops::grouped_varlen_attention`]), never
//! across documents; positions restart at 0 in each document (for the rotary embedding).
//!
//! The per-token tables the attention kernels need are built here on the host once, in O(N),
//! and uploaded to the device once, so that no layer reads anything back from the GPU.

use candle_core::{bail, Device, Result, Tensor};
use std::sync::Arc;

/// Document boundaries of a packed row (FlashAttention's `cu_seqlens`), with their per-token
/// tables on one device. Cheap to clone (shared tables).
///
/// Tables, each `(N,)` u32 on the device (the kernels read them as 32-bit integers):
/// - `first_key[i]`: the first token of `i`'s document, the lowest key query `i` may see;
/// - `last_query[j]`: the last token of `j`'s document, the highest query that may see key `j`;
/// - `positions[i] = i - first_key[i]`: the position of token `i` in its document.
///
/// Both `first_key` and `last_query` are non-decreasing along the row, which is what lets the
/// kernels skip whole 64-row tiles (the first row of a query tile has the tile's lowest first
/// key; the last row of a key tile the tile's highest last query).
#[derive(Clone, Debug)]
pub struct Segments {
    cu: Arc<Vec<usize>>,
    first_key_host: Arc<Vec<u32>>,
    first_key: Tensor,
    last_query: Tensor,
    positions: Tensor,
}

impl Segments {
    /// Checks `cu_seqlens` and builds the tables on `device`.
    ///
    /// `cu_seqlens` is FlashAttention's: it starts at 0, is strictly increasing (every document
    /// holds at least one token) and ends at the row length N; `[0]` is an empty row. Host work
    /// O(N), one upload per table.
    ///
    /// Errors (no panics): an empty `cu_seqlens`, a first offset other than 0, an offset not
    /// greater than the one before it (an empty document, or offsets out of order), N of 2^31
    /// or more (the kernels' 32-bit indices), an upload that fails.
    pub fn new(cu_seqlens: &[usize], device: &Device) -> Result<Self> {
        let op = "Segments::new";
        let Some((&first, rest)) = cu_seqlens.split_first() else {
            bail!("{op}: cu_seqlens is empty; pass [0, n0, n0 + n1, ..., N] (at least [0])")
        };
        if first != 0 {
            bail!("{op}: cu_seqlens must start at 0, found {first}; pass [0, n0, n0 + n1, ..., N]")
        }
        let mut prev = 0;
        for (i, &c) in rest.iter().enumerate() {
            if c <= prev {
                bail!(
                    "{op}: cu_seqlens[{}] = {c} is not greater than cu_seqlens[{i}] = {prev}: \
                     document {i} would be empty or the offsets out of order; drop empty \
                     documents and pass strictly increasing cumulative lengths",
                    i + 1
                )
            }
            prev = c;
        }
        let n = prev;
        if n > i32::MAX as usize {
            bail!("{op}: {n} tokens in one row exceed the kernels' 32-bit indices; split the row")
        }
        let mut first_key = Vec::with_capacity(n);
        let mut last_query = Vec::with_capacity(n);
        for w in cu_seqlens.windows(2) {
            let (s, e) = (w[0], w[1]);
            first_key.extend(std::iter::repeat_n(s as u32, e - s));
            last_query.extend(std::iter::repeat_n((e - 1) as u32, e - s));
        }
        let positions: Vec<u32> = (0..n as u32).zip(&first_key).map(|(i, f)| i - f).collect();
        let up = |v: &[u32]| Tensor::from_slice(v, n, device);
        Ok(Self {
            cu: Arc::new(cu_seqlens.to_vec()),
            first_key: up(&first_key)?,
            last_query: up(&last_query)?,
            positions: up(&positions)?,
            first_key_host: Arc::new(first_key),
        })
    }

    /// The cumulative offsets as given: `[0, n0, n0 + n1, ..., N]`.
    pub fn cu_seqlens(&self) -> &[usize] {
        &self.cu
    }

    /// N, the tokens of the row (the last offset).
    pub fn len(&self) -> usize {
        self.cu.last().copied().unwrap_or(0)
    }

    /// Whether the row holds no token (`cu_seqlens == [0]`).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of documents.
    pub fn docs(&self) -> usize {
        self.cu.len() - 1
    }

    /// The device the tables live on.
    pub fn device(&self) -> &Device {
        self.positions.device()
    }

    /// Positions restarting at 0 in each document, `(N,)` u32 on the device (for the rotary
    /// embedding: index the `(max positions, Dh/2)` tables with it).
    pub fn positions(&self) -> &Tensor {
        &self.positions
    }

    /// `first_key[i]`, the first token of `i`'s document, `(N,)` u32 on the device.
    pub fn first_key(&self) -> &Tensor {
        &self.first_key
    }

    /// `last_query[j]`, the last token of `j`'s document, `(N,)` u32 on the device.
    pub fn last_query(&self) -> &Tensor {
        &self.last_query
    }

    /// `first_key` on the host (the CPU reference's and the composed mask's copy).
    pub(crate) fn first_key_host(&self) -> &[u32] {
        &self.first_key_host
    }
}
