//! Byte-level language-modelling windows over a text file.
//!
//! With the file's bytes `b[0..N]` and a context length `T`, window `i` starts at
//! `s = i * stride` and is
//!
//! ```text
//! x = b[s .. s + T]          as u32 ids, shape (T,)   (the vocabulary is the 256 byte values)
//! y = b[s + 1 .. s + T + 1]  as u32 ids, shape (T,)   (next-byte targets: y[t] = x[t + 1])
//! ```
//!
//! for every `s` with `s + T + 1 <= N`, i.e. `(N - T - 1) / stride + 1` windows (stride 1:
//! a window at every start position, as nanoGPT's `get_batch` samples them). The [`Stack`]
//! collate gives batches `x: (B, T) u32`, `y: (B, T) u32`.
//!
//! [`TextWindows::split`] cuts the bytes at one position (e.g. the first 90% for training,
//! the rest for validation); windows never cross the cut, so no validation byte is ever a
//! training target.
//!
//! ```
//! use wick::data::{Dataset, TextWindows};
//! # fn main() -> anyhow::Result<()> {
//! let w = TextWindows::from_bytes(b"hello".to_vec(), 3)?;
//! assert_eq!(w.len(), 2); // "hel"->"ell", "ell"->"llo"
//! let s = w.get(1)?;
//! assert_eq!(s[0].to_vec1::<u32>()?, vec![b'e' as u32, b'l' as u32, b'l' as u32]);
//! assert_eq!(s[1].to_vec1::<u32>()?, vec![b'l' as u32, b'l' as u32, b'o' as u32]);
//! # Ok(()) }
//! ```
//!
//! [`Stack`]: super::Stack

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use candle_core::{Device, Tensor};

use super::Dataset;

/// Size of the byte vocabulary: ids are `0..256`.
pub const BYTE_VOCAB: usize = 256;

/// Context windows over a byte buffer (see the module docs). Cheap to clone: the bytes are
/// shared.
#[derive(Debug, Clone)]
pub struct TextWindows {
    bytes: Arc<[u8]>,
    /// The byte range of `bytes` this view covers (a [`TextWindows::split`] part).
    start: usize,
    end: usize,
    context_len: usize,
    stride: usize,
    /// Where the bytes came from, for messages.
    source: PathBuf,
}

impl TextWindows {
    /// Read all of `path` and make windows of `context_len` bytes at every start position.
    ///
    /// # Errors
    /// `context_len == 0`; the file cannot be read (the message names the path and the OS
    /// error, e.g. not found); the file has fewer than `context_len + 1` bytes (one window needs
    /// `T` inputs plus one more byte for the last target).
    pub fn from_file(path: impl AsRef<Path>, context_len: usize) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read text file {}", path.display()))?;
        Self::build(bytes, context_len, path.to_path_buf())
    }

    /// Windows over in-memory bytes (same rules and errors as [`TextWindows::from_file`]).
    pub fn from_bytes(bytes: Vec<u8>, context_len: usize) -> Result<Self> {
        Self::build(bytes, context_len, PathBuf::from("<memory>"))
    }

    fn build(bytes: Vec<u8>, context_len: usize, source: PathBuf) -> Result<Self> {
        ensure!(
            context_len >= 1,
            "context_len must be at least 1 for text windows over {}",
            source.display()
        );
        let n = bytes.len();
        ensure!(
            n > context_len,
            "text file {} has {n} bytes; a window of context_len {context_len} needs at least \
             {} bytes (context_len + 1 for the next-byte target)",
            source.display(),
            context_len + 1
        );
        Ok(Self {
            bytes: bytes.into(),
            start: 0,
            end: n,
            context_len,
            stride: 1,
            source,
        })
    }

    /// The same windows, starting every `stride` bytes instead of every byte (`stride = T`
    /// gives non-overlapping windows).
    ///
    /// # Errors
    /// `stride == 0`.
    pub fn with_stride(mut self, stride: usize) -> Result<Self> {
        ensure!(stride >= 1, "text window stride must be at least 1, got 0");
        self.stride = stride;
        Ok(self)
    }

    /// Split the bytes at position `floor(fraction * N)`: `(first part, second part)`, e.g.
    /// `split(0.9)` for a 90/10 train/validation split. Both parts keep the context length and
    /// stride; windows never cross the cut.
    ///
    /// # Errors
    /// `fraction` not strictly between 0 and 1; a part shorter than `context_len + 1` bytes
    /// (the message gives both sizes).
    pub fn split(&self, fraction: f64) -> Result<(Self, Self)> {
        ensure!(
            fraction > 0.0 && fraction < 1.0,
            "split fraction must be strictly between 0 and 1, got {fraction}"
        );
        let n = self.end - self.start;
        let cut = self.start + ((n as f64) * fraction).floor() as usize;
        let (a, b) = (cut - self.start, self.end - cut);
        let need = self.context_len + 1;
        ensure!(
            a >= need && b >= need,
            "splitting the {n} bytes of {} at {fraction} gives parts of {a} and {b} bytes; each \
             needs at least {need} (context_len + 1)",
            self.source.display()
        );
        let first = Self {
            end: cut,
            ..self.clone()
        };
        let second = Self {
            start: cut,
            ..self.clone()
        };
        Ok((first, second))
    }

    /// Context length `T`.
    pub fn context_len(&self) -> usize {
        self.context_len
    }

    /// Distance between consecutive window starts.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// The bytes this view covers.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes[self.start..self.end]
    }

    /// Window `index` as `(x, y)` byte ids (see the module docs), without building tensors.
    ///
    /// # Errors
    /// `index >= len()`.
    pub fn window(&self, index: usize) -> Result<(Vec<u32>, Vec<u32>)> {
        ensure!(
            index < self.len(),
            "window {index} out of range: {} has {} windows",
            self.source.display(),
            self.len()
        );
        let s = self.start + index * self.stride;
        let t = self.context_len;
        let x = self.bytes[s..s + t].iter().map(|&b| b as u32).collect();
        let y = self.bytes[s + 1..s + t + 1]
            .iter()
            .map(|&b| b as u32)
            .collect();
        Ok((x, y))
    }
}

impl Dataset for TextWindows {
    /// `[x, y]`, each `(T,)` `u32`.
    type Sample = Vec<Tensor>;

    /// `(N - T - 1) / stride + 1` for the `N` bytes of this view.
    fn len(&self) -> usize {
        let n = self.end - self.start;
        if n <= self.context_len {
            0
        } else {
            (n - self.context_len - 1) / self.stride + 1
        }
    }

    fn get(&self, index: usize) -> Result<Vec<Tensor>> {
        let (x, y) = self.window(index)?;
        let t = self.context_len;
        Ok(vec![
            Tensor::from_vec(x, t, &Device::Cpu)?,
            Tensor::from_vec(y, t, &Device::Cpu)?,
        ])
    }
}
