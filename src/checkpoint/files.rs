//! Bytes on disk: safetensors serialisation with SHA-256, checked reads, fsync'd writes and
//! the atomic install of a checkpoint directory; small naming helpers.

use super::*;

// ---------------------------------------------------------------------------------------------
// helpers

/// The optimizer's name: the variant of [`crate::engine::OptimizerConfig`] (`"AdamW"`, `"Sgd"`).
pub(super) fn optimizer_name(engine: &Engine) -> String {
    let debug = format!("{:?}", engine.config().optimizer);
    debug
        .split(|c: char| !c.is_alphanumeric() && c != '_')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// `["a", "b", ...]`, at most 10 names.
pub(super) fn name_list(names: &[&str]) -> String {
    let shown: Vec<String> = names.iter().take(10).map(|n| format!("{n:?}")).collect();
    if names.len() > 10 {
        format!("[{}, ... {} more]", shown.join(", "), names.len() - 10)
    } else {
        format!("[{}]", shown.join(", "))
    }
}

pub(super) fn step_dir_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step:06}")
}

pub(super) fn digest(bytes: &[u8]) -> FileDigest {
    FileDigest {
        bytes: bytes.len() as u64,
        sha256: hex(&Sha256::digest(bytes)),
    }
}

pub(super) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Reads `dir/file`, checks its size and SHA-256 against `state`, and parses it as
/// safetensors into CPU tensors.
pub(super) fn read_checked(
    dir: &Path,
    file: &str,
    state: &TrainerState,
) -> Result<HashMap<String, Tensor>> {
    let path = dir.join(file);
    let expected = state.files.get(file).ok_or_else(|| {
        anyhow!(
            "checkpoint {}: no checksum for {file} in {STATE_FILE}",
            dir.join(STATE_FILE).display()
        )
    })?;
    let bytes =
        fs::read(&path).with_context(|| format!("checkpoint {}: cannot read", path.display()))?;
    ensure!(
        bytes.len() as u64 == expected.bytes,
        "checkpoint {}: truncated or incomplete file: {} bytes, {STATE_FILE} records {}",
        path.display(),
        bytes.len(),
        expected.bytes
    );
    let got = hex(&Sha256::digest(&bytes));
    ensure!(
        got == expected.sha256,
        "checkpoint {}: checksum mismatch: sha256 {got}, {STATE_FILE} records {} (the file is \
         corrupt or was modified)",
        path.display(),
        expected.sha256
    );
    candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).with_context(|| {
        format!(
            "checkpoint {}: corrupt file: not a valid safetensors file",
            path.display()
        )
    })
}

/// One tensor's bytes, ready for `safetensors::serialize`.
pub(super) struct Raw {
    dtype: StDtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Raw {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

pub(super) fn le_bytes<T: Copy, const N: usize>(v: Vec<T>, f: fn(T) -> [u8; N]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * N);
    for x in v {
        out.extend_from_slice(&f(x));
    }
    out
}

pub(super) fn raw_tensor(t: &Tensor) -> Result<Raw> {
    let flat = t.flatten_all()?.to_device(&Device::Cpu)?;
    let (dtype, data) = match t.dtype() {
        DType::F32 => (
            StDtype::F32,
            le_bytes(flat.to_vec1::<f32>()?, f32::to_le_bytes),
        ),
        DType::F64 => (
            StDtype::F64,
            le_bytes(flat.to_vec1::<f64>()?, f64::to_le_bytes),
        ),
        DType::BF16 => (
            StDtype::BF16,
            le_bytes(flat.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
        ),
        DType::F16 => (
            StDtype::F16,
            le_bytes(flat.to_vec1::<half::f16>()?, half::f16::to_le_bytes),
        ),
        DType::U32 => (
            StDtype::U32,
            le_bytes(flat.to_vec1::<u32>()?, u32::to_le_bytes),
        ),
        DType::I64 => (
            StDtype::I64,
            le_bytes(flat.to_vec1::<i64>()?, i64::to_le_bytes),
        ),
        DType::U8 => (StDtype::U8, flat.to_vec1::<u8>()?),
        other => bail!("dtype {other:?} is not supported in checkpoints"),
    };
    Ok(Raw {
        dtype,
        shape: t.dims().to_vec(),
        data,
    })
}

/// Serialises named tensors (any device) into a safetensors byte buffer; returns it with its
/// size and SHA-256.
pub(super) fn serialize_tensors(
    tensors: Vec<(String, Tensor)>,
    file: &str,
) -> Result<(Vec<u8>, FileDigest)> {
    let mut raws = BTreeMap::new();
    for (name, t) in tensors {
        let raw =
            raw_tensor(&t).with_context(|| format!("checkpoint save: {file}: tensor {name:?}"))?;
        if raws.insert(name.clone(), raw).is_some() {
            bail!("checkpoint save: {file}: two tensors are named {name:?}");
        }
    }
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let bytes = safetensors::serialize(raws.iter().map(|(k, v)| (k.as_str(), v)), Some(meta))
        .map_err(|e| anyhow!("checkpoint save: {file}: safetensors serialisation failed: {e}"))?;
    drop(raws);
    let d = digest(&bytes);
    Ok((bytes, d))
}

pub(super) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path)
        .with_context(|| format!("checkpoint save: creating {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("checkpoint save: writing {}", path.display()))?;
    f.sync_all()
        .with_context(|| format!("checkpoint save: fsync {}", path.display()))?;
    Ok(())
}

/// fsyncs a directory so that the entries created or renamed in it are durable.
pub(super) fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("checkpoint: fsync of directory {}", dir.display()))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Moves the finished `tmp` directory to `dst`. When `dst` exists (the same step saved
/// twice), exchanges the two atomically where the OS can, then deletes the old one.
pub(super) fn install_dir(tmp: &Path, dst: &Path, root: &Path, pid: u32) -> Result<()> {
    if !dst.exists() {
        return fs::rename(tmp, dst).with_context(|| {
            format!(
                "checkpoint save: renaming {} to {}",
                tmp.display(),
                dst.display()
            )
        });
    }
    if exchange(tmp, dst) {
        // `tmp` now holds the old checkpoint
        sync_dir(root)?;
        fs::remove_dir_all(tmp)
            .with_context(|| format!("checkpoint save: removing {}", tmp.display()))?;
        return Ok(());
    }
    // no atomic exchange: move the old one aside (a short window without this step's
    // directory; earlier checkpoints stay intact), then move the new one in
    let name = dst
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let old = root.join(format!("{TMP_PREFIX}old-{name}-{pid}"));
    fs::rename(dst, &old).with_context(|| {
        format!(
            "checkpoint save: renaming {} to {}",
            dst.display(),
            old.display()
        )
    })?;
    if let Err(e) = fs::rename(tmp, dst) {
        let _ = fs::rename(&old, dst); // put the previous checkpoint back
        return Err(e).with_context(|| {
            format!(
                "checkpoint save: renaming {} to {}",
                tmp.display(),
                dst.display()
            )
        });
    }
    sync_dir(root)?;
    fs::remove_dir_all(&old).with_context(|| format!("checkpoint save: removing {}", old.display()))
}

/// Atomically swaps two paths (Linux `renameat2(RENAME_EXCHANGE)`); false when unsupported.
#[cfg(target_os = "linux")]
pub(super) fn exchange(a: &Path, b: &Path) -> bool {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let (Ok(ca), Ok(cb)) = (
        CString::new(a.as_os_str().as_bytes()),
        CString::new(b.as_os_str().as_bytes()),
    ) else {
        return false;
    };
    // SAFETY: both pointers are valid NUL-terminated strings for the duration of the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    rc == 0
}

#[cfg(not(target_os = "linux"))]
pub(super) fn exchange(_a: &Path, _b: &Path) -> bool {
    false
}

/// Whether process `pid` still exists (Linux: /proc; elsewhere assume it does, so that
/// another process's save in progress is never removed).
pub(super) fn process_alive(pid: u32) -> bool {
    let proc_root = Path::new("/proc");
    if proc_root.join("self").exists() {
        proc_root.join(pid.to_string()).exists()
    } else {
        true
    }
}
