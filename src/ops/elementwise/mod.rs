//! Elementwise ops and the gated activations: each output element from the elements at its
//! own position (and a bias broadcast over the rows).

pub(super) mod bias;
pub(super) mod geglu;
pub(super) mod gelu;
pub(super) mod relu;
pub(super) mod residual;
pub(super) mod swiglu;
