//! Access to the data of a CPU storage inside a custom op's `cpu_fwd`.

use candle_core::{bail, CpuStorage, Layout, Result};

/// The contiguous data of a CPU storage as `&[T]`.
pub(crate) fn cpu_slice<'a, T: candle_core::WithDType>(
    op: &str,
    what: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<&'a [T]> {
    let Some((o1, o2)) = l.contiguous_offsets() else {
        bail!("{op}: {what} must be contiguous (internal error: the public function makes it so)")
    };
    Ok(&T::cpu_storage_as_slice(s)?[o1..o2])
}
