//! Host side of the CUDA multi-tensor apply (kernels/multi_tensor.cuh): packs a list of tensors
//! into launches of at most [`MAX_TENSORS`] tensors and [`MAX_BLOCKS`] blocks, one block per
//! chunk of [`CHUNK`] elements, with the address table passed by value as a kernel argument
//! (up to 32,764 bytes of kernel parameters since CUDA 12.1, on Volta and newer: one launch
//! covers a GPT-2-sized model).
//!
//! Empty tensors are dropped from the table; tensors larger than a chunk span several blocks
//! (and possibly several launches); thousands of tiny tensors become many launches of
//! [`MAX_TENSORS`] tensors each.

//!
//! This planning is plain Rust (no CUDA), so it is unit-tested on every machine.

/// Elements per chunk (one thread block each). Must match `MT_CHUNK`.
pub const CHUNK: usize = 65536;
/// Threads per block. Must match `MT_BLOCK`.
pub const BLOCK: u32 = 512;
/// Tensors per launch. Must match `MT_MAX_TENSORS`.
pub const MAX_TENSORS: usize = 160;
/// Blocks per launch. Must match `MT_MAX_BLOCKS`.
pub const MAX_BLOCKS: usize = 2816;

/// Mirror of `TensorListMeta<DEPTH>` (same field order, C layout).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Meta<const D: usize> {
    addr: [[u64; MAX_TENSORS]; D],
    numel: [i64; MAX_TENSORS],
    block_tensor: [i32; MAX_BLOCKS],
    block_chunk: [i32; MAX_BLOCKS],
    tensor_group: [i32; MAX_TENSORS],
    tensor_index: [i32; MAX_TENSORS],
}

impl<const D: usize> Meta<D> {
    fn empty() -> Self {
        Self {
            addr: [[0; MAX_TENSORS]; D],
            numel: [0; MAX_TENSORS],
            block_tensor: [0; MAX_BLOCKS],
            block_chunk: [0; MAX_BLOCKS],
            tensor_group: [0; MAX_TENSORS],
            tensor_index: [0; MAX_TENSORS],
        }
    }
}

/// One tensor of the list: its `D` addresses (0 = absent, e.g. no working copy), element count,
/// group attribute and index in the caller's list.
#[derive(Clone, Copy, Debug)]
pub struct Row<const D: usize> {
    /// Device addresses, one per list (0 = absent).
    pub addrs: [u64; D],
    /// Elements in the tensor.
    pub numel: usize,
    /// Per-tensor attribute the kernel reads (e.g. weight-decay group, "first" flag).
    pub group: i32,
    /// Index of the tensor in the caller's list.
    pub index: i32,
}

/// One launch: the table and the number of blocks it uses.
#[derive(Clone, Copy, Debug)]
pub struct Launch<const D: usize> {
    /// The address table passed to the kernel by value.
    pub meta: Meta<D>,
    /// Thread blocks of this launch (one chunk each).
    pub blocks: u32,
    /// Blocks of all earlier launches (offset into per-block outputs).
    pub block_offset: u32,
}

/// Splits `rows` into launches (see the module docs). Returns no launch when every tensor is
/// empty.
pub fn plan<const D: usize>(rows: &[Row<D>]) -> Vec<Launch<D>> {
    let mut out = Vec::new();
    let mut meta = Meta::<D>::empty();
    let (mut nt, mut nb, mut offset) = (0usize, 0usize, 0u32);
    for row in rows.iter().filter(|r| r.numel > 0) {
        let chunks = row.numel.div_ceil(CHUNK);
        let mut slot = None;
        for chunk in 0..chunks {
            if slot.is_none() {
                if nt == MAX_TENSORS {
                    out.push(Launch {
                        meta,
                        blocks: nb as u32,
                        block_offset: offset,
                    });
                    offset += nb as u32;
                    (meta, nt, nb) = (Meta::empty(), 0, 0);
                }
                for d in 0..D {
                    meta.addr[d][nt] = row.addrs[d];
                }
                meta.numel[nt] = row.numel as i64;
                meta.tensor_group[nt] = row.group;
                meta.tensor_index[nt] = row.index;
                slot = Some(nt);
                nt += 1;
            }
            let s = slot.expect("slot set above");
            meta.block_tensor[nb] = s as i32;
            meta.block_chunk[nb] = chunk as i32;
            nb += 1;
            if nb == MAX_BLOCKS {
                out.push(Launch {
                    meta,
                    blocks: nb as u32,
                    block_offset: offset,
                });
                offset += nb as u32;
                // the next launch starts empty; an unfinished tensor is registered there again
                (meta, nt, nb) = (Meta::empty(), 0, 0);
                slot = None;
            }
        }
    }
    if nb > 0 {
        out.push(Launch {
            meta,
            blocks: nb as u32,
            block_offset: offset,
        });
    }
    out
}

/// Total blocks over all launches.
pub fn total_blocks<const D: usize>(launches: &[Launch<D>]) -> u32 {
    launches.iter().map(|l| l.blocks).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(numel: usize, index: i32) -> Row<2> {
        Row {
            addrs: [1000 + index as u64, 0],
            numel,
            group: 0,
            index,
        }
    }

    #[test]
    fn meta_fits_the_kernel_parameter_limit() {
        // 32,764 bytes of parameters per kernel (CUDA >= 12.1); the update kernels pass two
        // pointers and their rule's arguments (under 64 bytes) beside the table
        assert!(std::mem::size_of::<Meta<5>>() + 128 <= 32764);
    }

    #[test]
    fn every_chunk_is_covered_once() {
        // empty tensors, a tensor spanning many launches, thousands of tiny tensors
        let mut rows = vec![row(0, 0), row(3 * CHUNK * MAX_BLOCKS / 2 + 7, 1), row(0, 2)];
        rows.extend((3..3003).map(|i| row(1 + (i as usize % 5), i)));
        let launches = plan(&rows);
        let mut seen = std::collections::BTreeMap::<(i32, i32), u32>::new();
        let mut offset = 0;
        for l in &launches {
            assert_eq!(l.block_offset, offset);
            offset += l.blocks;
            assert!(l.blocks as usize <= MAX_BLOCKS);
            for b in 0..l.blocks as usize {
                let t = l.meta.block_tensor[b] as usize;
                assert!(t < MAX_TENSORS);
                *seen
                    .entry((l.meta.tensor_index[t], l.meta.block_chunk[b]))
                    .or_default() += 1;
                assert_eq!(l.meta.addr[0][t], 1000 + l.meta.tensor_index[t] as u64);
            }
        }
        let mut want = std::collections::BTreeMap::new();
        for r in rows.iter().filter(|r| r.numel > 0) {
            for c in 0..r.numel.div_ceil(CHUNK) {
                want.insert((r.index, c as i32), 1u32);
            }
        }
        assert_eq!(seen, want);
        assert!(plan::<2>(&[row(0, 0)]).is_empty());
    }
}
