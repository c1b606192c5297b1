//! The library is embeddable in a multi-threaded service: its engine, stores, optimizers,
//! loaders, models and serving types can move to (Send) or be shared between (Sync) threads.
//! Compile-time checks: this file does not build if one of them stops being so.

use wick::data::{DataLoader, TensorDataset};
use wick::models::{Bert, Decoder, DecoderWeights, Gpt, KvCache};
use wick::optim::{AdamW, Sgd};
use wick::serve::{FeedbackReceiver, FeedbackSender, OnlineStats, ParamSnapshot, Published};
use wick::{Engine, ParamStore};

fn send<T: Send>() {}
fn send_sync<T: Send + Sync>() {}

#[test]
fn library_types_are_send_and_sync_where_shared() {
    // moved into a trainer thread
    send::<Engine>();
    send::<AdamW>();
    send::<Sgd>();
    send::<DataLoader<TensorDataset>>();
    send::<FeedbackReceiver<Vec<f32>>>();
    send::<KvCache>();
    // shared between request handlers and the trainer
    send_sync::<ParamStore>();
    send_sync::<Decoder>();
    send_sync::<Gpt>();
    send_sync::<Bert>();
    send_sync::<DecoderWeights>();
    send_sync::<ParamSnapshot>();
    send_sync::<Published<Decoder>>();
    send_sync::<FeedbackSender<Vec<f32>>>();
    send_sync::<OnlineStats>();
    #[cfg(feature = "tokenizers")]
    send_sync::<wick::models::tokenizer::TextTokenizer>();
}
