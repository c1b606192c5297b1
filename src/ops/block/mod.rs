//! Transformer blocks as one graph node under the engine's backward: pre-norm halves in a row
//! and post-norm sub-blocks, built from the other kinds' ops. The vocabulary ([`layer`]: a
//! branch's layers and its norm) and the one-node steps ([`step`]) they share. Nothing below
//! this kind imports it.

pub(super) mod layer;
pub(super) mod post_norm;
pub(super) mod pre_norm;
pub(super) mod step;
