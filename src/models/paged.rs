//! [`PagedKvCache`]: the keys and values of many sequences in one preallocated pool of
//! fixed-size blocks per layer, with a free list and a [`BlockTable`] per sequence (vLLM's
//! PagedAttention memory manager, Kwon et al. 2023). Nothing is allocated per request: a
//! sequence takes blocks from the free list and gives them back when it finishes, so a
//! finished sequence's memory serves the next one at once and fragmentation is at most one
//! partly filled block per sequence. [`super::Decoder::forward_paged`] runs a batch of
//! sequences at their own positions over it ([`crate::ops::paged_attention`]).

use super::config::DecoderConfig;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

/// Why blocks could not be taken: the pool has too few free ones now. A scheduler queues the
/// request (or answers 429) and retries when sequences finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfBlocks {
    /// Blocks asked for.
    pub needed: usize,
    /// Blocks free.
    pub free: usize,
}

impl std::fmt::Display for OutOfBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the paged KV cache has {} free block(s), {} needed; wait for running sequences to \
             finish or make the cache larger",
            self.free, self.needed
        )
    }
}

impl std::error::Error for OutOfBlocks {}

/// The blocks of one sequence, in position order: position `p` lives in block
/// `blocks[p / block_size]` at offset `p % block_size`. Made by [`PagedKvCache::allocate`],
/// given back with [`PagedKvCache::release`] (not `Clone`: a block has one owner).
#[derive(Debug, Default)]
pub struct BlockTable {
    blocks: Vec<u32>,
}

impl BlockTable {
    /// The block ids.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }
}

/// Keys and values of every layer in blocks of `block_size` positions: per layer a key pool
/// and a value pool `(num_blocks · block_size, Hkv · D)` in the model's compute dtype on its
/// device, made once. One cache serves every sequence of a scheduler (and every published
/// version of the weights: a sequence's keys are those of the version it runs on).
///
/// A sliding-window layer keeps every position of a sequence here too (the window is a mask
/// in the attention), so a sequence's blocks are sized by its whole length; freeing the
/// blocks that fell out of every layer's window is not done.
pub struct PagedKvCache {
    block_size: usize,
    num_blocks: usize,
    kv_heads: usize,
    head_dim: usize,
    layers: Vec<(Tensor, Tensor)>,
    /// Free block ids; taken from the end.
    free: Vec<u32>,
}

impl PagedKvCache {
    /// A cache for a model of `config` whose forward computes in `dtype` on `device`:
    /// `num_blocks` blocks of `block_size` positions per layer, all free. Memory:
    /// `2 · layers · num_blocks · block_size · Hkv · D` elements of `dtype`, zero-filled.
    ///
    /// Errors: `block_size` or `num_blocks` 0, more than `u32::MAX` slots, a failed
    /// allocation (out of device memory).
    pub fn new(
        config: &DecoderConfig,
        dtype: DType,
        device: &Device,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self> {
        if block_size == 0 || num_blocks == 0 {
            bail!(
                "PagedKvCache::new: block_size ({block_size}) and num_blocks ({num_blocks}) \
                 must be >= 1"
            );
        }
        let slots = block_size
            .checked_mul(num_blocks)
            .filter(|&s| s <= u32::MAX as usize);
        let Some(slots) = slots else {
            bail!("PagedKvCache::new: {num_blocks} blocks of {block_size} exceed u32 slot ids");
        };
        let (kv_heads, head_dim) = (config.num_key_value_heads, config.head_dim());
        let pool = || Tensor::zeros((slots, kv_heads * head_dim), dtype, device);
        let layers = (0..config.num_hidden_layers)
            .map(|_| Ok((pool()?, pool()?)))
            .collect::<Result<_>>()?;
        Ok(Self {
            block_size,
            num_blocks,
            kv_heads,
            head_dim,
            layers,
            free: (0..num_blocks as u32).rev().collect(),
        })
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks on the free list.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks that `tokens` positions take.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// The layers' `(key pool, value pool)`.
    pub fn layers(&self) -> &[(Tensor, Tensor)] {
        &self.layers
    }

    /// `(Hkv, D)` of the pools.
    pub fn kv_shape(&self) -> (usize, usize) {
        (self.kv_heads, self.head_dim)
    }

    /// The pools' dtype.
    pub fn dtype(&self) -> DType {
        self.layers[0].0.dtype()
    }

    /// A table holding room for `tokens` positions, its blocks taken from the free list.
    ///
    /// Errors: [`OutOfBlocks`] when the free list is too short (nothing is taken then).
    pub fn allocate(&mut self, tokens: usize) -> Result<BlockTable, OutOfBlocks> {
        let mut table = BlockTable::default();
        self.grow(&mut table, tokens)?;
        Ok(table)
    }

    /// Extends `table` to hold `tokens` positions (no change when it does already).
    ///
    /// Errors: [`OutOfBlocks`] when the free list is too short (nothing is taken then).
    pub fn grow(&mut self, table: &mut BlockTable, tokens: usize) -> Result<(), OutOfBlocks> {
        let needed = self.blocks_for(tokens).saturating_sub(table.blocks.len());
        if needed > self.free.len() {
            return Err(OutOfBlocks {
                needed,
                free: self.free.len(),
            });
        }
        let at = self.free.len() - needed;
        table.blocks.extend(self.free.drain(at..).rev());
        Ok(())
    }

    /// Gives `table`'s blocks back to the free list. Their contents stay until overwritten:
    /// a later sequence writes every position before it reads it.
    pub fn release(&mut self, table: BlockTable) {
        self.free.extend(table.blocks.into_iter().rev());
    }

    /// The pool slots of `positions` of `table`'s sequence (slot = block · block size +
    /// offset).
    ///
    /// Errors: a position past the table's blocks.
    pub fn slots(&self, table: &BlockTable, positions: std::ops::Range<usize>) -> Result<Vec<u32>> {
        let bs = self.block_size;
        if positions.end > table.blocks.len() * bs {
            bail!(
                "PagedKvCache: position {} is past the sequence's {} block(s) of {bs}; grow its \
                 table first",
                positions.end.saturating_sub(1),
                table.blocks.len()
            );
        }
        Ok(positions
            .map(|p| table.blocks[p / bs] * bs as u32 + (p % bs) as u32)
            .collect())
    }
}
