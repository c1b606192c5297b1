//! Attention and what it is made of: the fused causal (flash) op and its windowed and packed
//! (varlen) forms, the composed attention of other scales and the KV cache, key-padding
//! attention, the masked softmaxes, the head split and merge, the rotary embedding, and the
//! vocabulary of a fused q/k/v projection ([`qkv`]) and of packed documents ([`segments`]).

pub(super) mod cached;
pub(super) mod causal;
pub(super) mod composed;
pub(super) mod heads;
pub(super) mod padded;
pub(super) mod paged;
pub(super) mod qkv;
pub(super) mod rotary;
pub(super) mod segments;
pub(super) mod softmax;
pub(super) mod varlen;
pub(super) mod window;
