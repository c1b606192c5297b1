//! The toolkit every op kind builds on: the storage element types and the dtype dispatch
//! ([`dtype`]: `with_type!`, [`Elem`]), argument checks with their errors ([`checks`]), CPU
//! storage access ([`cpu`]), and the tensor an op leaves beside its output ([`side_output`]).
//! Nothing here is an op; nothing here imports an op.

#[macro_use]
pub(super) mod dtype;
pub(super) mod checks;
pub(super) mod cpu;
pub(super) mod side_output;

pub(crate) use checks::{check_device, check_float, index_u32};
pub(crate) use cpu::cpu_slice;
pub(crate) use dtype::Elem;
pub(crate) use side_output::SideOutput;
