//! Cross-entropy losses: over given logits, and fused with the head's linear (the logits never
//! a graph tensor; in chunks of rows with the gradient made in the forward).

pub(super) mod chunked_cross_entropy;
pub(super) mod cross_entropy;
pub(super) mod linear_cross_entropy;
