//! The benchmarks behind `wick bench`: [`optim`] (one AdamW step, reference against fused)
//! and [`step`] (full GPT training steps). Each has its clap arguments and a `run` function,
//! so the binary only parses and calls, and other programs can run them too.

pub mod optim;
pub mod step;
