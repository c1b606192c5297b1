//! Process-wide performance and reproducibility settings, applied once at the start of a run
//! and printed in its header.
//!
//! ```
//! use wick::perf::PerfSettings;
//! use candle_core::Device;
//! let perf = PerfSettings { seed: 7, tf32: true, ..PerfSettings::default() };
//! perf.apply(&Device::Cpu).unwrap();
//! assert_eq!(wick::perf::global_seed(), Some(7));
//! println!("{}", perf.header());
//! ```
//!
//! What each knob does:
//! - `seed`: seeds candle's CUDA generator (`Device::set_seed`, cuRAND) and is stored
//!   process-wide ([`global_seed`]) so that the ParamStore initialisation and the DataLoader's
//!   shuffling derive their seeds from it ([`PerfSettings::derive_seed`]). candle's CPU random
//!   ops (`Tensor::randn`/`rand` on the CPU) draw from an unseedable thread RNG: CPU runs are
//!   reproducible only through wick's own seeded generators.
//! - `tf32`: f32 GEMMs on CUDA run on tensor cores in TF32 (10-bit mantissa inputs, f32
//!   accumulation): candle's `set_gemm_reduced_precision_f32`, i.e. cuBLAS
//!   `CUBLAS_COMPUTE_32F_FAST_TF32` (PyTorch: `torch.backends.cuda.matmul.allow_tf32`).
//!   Needs compute capability >= 8.0; measured on an H200: 4096³ f32 matmul 51 → 390 TFLOP/s.
//!   The same switch makes f32 flash attention ([`crate::ops::causal_attention`]) take plain
//!   TF32 operands instead of 3xTF32.
//! - `reduced_precision_reductions`: bf16 GEMMs use `CUBLAS_COMPUTE_32F_FAST_16BF` and f16
//!   GEMMs accumulate in f16 (`CUBLAS_COMPUTE_16F`): candle's
//!   `set_gemm_reduced_precision_{bf16,f16}`. Faster, but f16 accumulation loses precision on
//!   long reductions; off by default, as in candle.
//! - `deterministic`: asks for run-to-run bitwise-identical results on the same GPU and
//!   build. cuBLAS is deterministic on one stream with a fixed workspace; PyTorch requires
//!   `CUBLAS_WORKSPACE_CONFIG=:4096:8` for the same guarantee, and [`PerfSettings::prepare_env`]
//!   sets it (call it first thing in `main`, before any thread or CUDA device exists).
//!   candle's CUDA `index_add`/`scatter_add` (embedding backward) use atomics and stay
//!   non-deterministic in their summation order; the header says so.
//!
//! All three GEMM switches are process-wide in candle (atomics read at every GEMM), so they
//! apply to every CUDA device of the process. Without the `cuda` feature they do nothing.

use anyhow::{Context, Result};
use candle_core::Device;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The cuBLAS workspace setting that makes cuBLAS results reproducible (as in PyTorch).
pub const CUBLAS_WORKSPACE_CONFIG: &str = ":4096:8";

static SEED: AtomicU64 = AtomicU64::new(0);
static SEEDED: AtomicBool = AtomicBool::new(false);
static DETERMINISTIC: AtomicBool = AtomicBool::new(false);

/// The seed set by the last [`PerfSettings::apply`], if any.
pub fn global_seed() -> Option<u64> {
    SEEDED
        .load(Ordering::Acquire)
        .then(|| SEED.load(Ordering::Relaxed))
}

/// Whether the last [`PerfSettings::apply`] asked for deterministic execution.
pub fn deterministic() -> bool {
    DETERMINISTIC.load(Ordering::Relaxed)
}

/// Seed, GEMM precision switches and determinism for one run. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PerfSettings {
    /// Seed of every random generator of the run.
    pub seed: u64,
    /// Allow TF32 tensor-core math for f32 GEMMs and f32 flash attention on CUDA (compute
    /// capability >= 8.0).
    pub tf32: bool,
    /// Allow reduced-precision accumulation in bf16 and f16 GEMMs on CUDA.
    pub reduced_precision_reductions: bool,
    /// Ask for reproducible results (fixed cuBLAS workspace, seeded generators).
    pub deterministic: bool,
    /// CUDA: bytes the device memory pool keeps reserved across synchronisations
    /// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`, see `wick::cuda::memory::set_release_threshold`
    /// on CUDA builds). `u64::MAX` keeps freed memory for reuse as PyTorch's caching allocator
    /// does; `0` (the driver's default) returns it at every synchronisation, so the next step
    /// maps it again; `None` leaves the pool as it is.
    pub pool_release_threshold: Option<u64>,
}

impl Default for PerfSettings {
    /// Seed 0, exact f32 GEMMs, full-precision reductions, not deterministic: candle's and
    /// PyTorch's defaults for matmuls; the CUDA memory pool keeps freed memory (as PyTorch's
    /// caching allocator).
    fn default() -> Self {
        PerfSettings {
            seed: 0,
            tf32: false,
            reduced_precision_reductions: false,
            deterministic: false,
            pool_release_threshold: Some(u64::MAX),
        }
    }
}

impl PerfSettings {
    /// The fast settings for Ampere-or-newer GPUs: TF32 on, reduced-precision reductions off.
    pub fn fast(seed: u64) -> Self {
        PerfSettings {
            seed,
            tf32: true,
            ..Self::default()
        }
    }

    /// Sets the environment variables the settings need, before CUDA is initialised: with
    /// `deterministic`, `CUBLAS_WORKSPACE_CONFIG=:4096:8` unless already set. Call it first in
    /// `main`, while the process has one thread (setting the environment while other threads
    /// read it is unsound in C libraries). Returns the variables it set.
    pub fn prepare_env(&self) -> Vec<(String, String)> {
        let mut set = Vec::new();
        if self.deterministic && std::env::var_os("CUBLAS_WORKSPACE_CONFIG").is_none() {
            std::env::set_var("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG);
            set.push((
                "CUBLAS_WORKSPACE_CONFIG".to_string(),
                CUBLAS_WORKSPACE_CONFIG.to_string(),
            ));
        }
        set
    }

    /// Applies the settings: stores the seed process-wide, seeds the CUDA generator of
    /// `device`, and sets candle's cuBLAS precision switches and the memory pool's release
    /// threshold (CUDA builds only).
    pub fn apply(&self, device: &Device) -> Result<()> {
        SEED.store(self.seed, Ordering::Relaxed);
        SEEDED.store(true, Ordering::Release);
        DETERMINISTIC.store(self.deterministic, Ordering::Relaxed);
        // candle's CPU backend refuses set_seed (its CPU RNG is not seedable).
        if !device.is_cpu() {
            device
                .set_seed(self.seed)
                .with_context(|| format!("seeding {device:?} with {}", self.seed))?;
        }
        #[cfg(feature = "cuda")]
        {
            candle_core::cuda::set_gemm_reduced_precision_f32(self.tf32);
            candle_core::cuda::set_gemm_reduced_precision_bf16(self.reduced_precision_reductions);
            candle_core::cuda::set_gemm_reduced_precision_f16(self.reduced_precision_reductions);
            if let (Some(bytes), Device::Cuda(d)) = (self.pool_release_threshold, device) {
                crate::cuda::memory::set_release_threshold(d, bytes)
                    .context("setting the CUDA memory pool's release threshold")?;
            }
        }
        Ok(())
    }

    /// A seed for one consumer of randomness (`"params"`, `"loader"`, `"dropout"`...), derived
    /// from `seed` so that consumers draw independent streams and adding one does not shift
    /// the others. SplitMix64 over the seed and an FNV-1a hash of the name.
    pub fn derive_seed(&self, stream: &str) -> u64 {
        derive_seed(self.seed, stream)
    }

    /// One line for the run header: the settings, and on CUDA builds the state of candle's
    /// cuBLAS switches as read back from candle.
    pub fn header(&self) -> String {
        let on = |b: bool| if b { "on" } else { "off" };
        let mut s = format!(
            "perf: seed {} | tf32 {} | reduced-precision reductions {} | deterministic {}",
            self.seed,
            on(self.tf32),
            on(self.reduced_precision_reductions),
            on(self.deterministic)
        );
        match self.pool_release_threshold {
            _ if !cfg!(feature = "cuda") => {}
            Some(u64::MAX) => s.push_str(" | CUDA memory pool keeps freed memory"),
            Some(b) => s.push_str(&format!(" | CUDA memory pool release threshold {b} B")),
            None => {}
        }
        #[cfg(feature = "cuda")]
        {
            s.push_str(&format!(
                " | cuBLAS: f32 {}, bf16 {}, f16 {}",
                if candle_core::cuda::gemm_reduced_precision_f32() {
                    "TF32"
                } else {
                    "exact"
                },
                if candle_core::cuda::gemm_reduced_precision_bf16() {
                    "fast-16bf"
                } else {
                    "f32-acc"
                },
                if candle_core::cuda::gemm_reduced_precision_f16() {
                    "f16-acc"
                } else {
                    "f32-acc"
                },
            ));
        }
        #[cfg(not(feature = "cuda"))]
        if self.tf32 || self.reduced_precision_reductions {
            s.push_str(" (GEMM switches have no effect: CPU build)");
        }
        if self.deterministic {
            match std::env::var("CUBLAS_WORKSPACE_CONFIG") {
                Ok(v) => s.push_str(&format!(" | CUBLAS_WORKSPACE_CONFIG={v}")),
                Err(_) if cfg!(feature = "cuda") => s.push_str(
                    " | CUBLAS_WORKSPACE_CONFIG unset: export CUBLAS_WORKSPACE_CONFIG=:4096:8",
                ),
                Err(_) => {}
            }
            if cfg!(feature = "cuda") {
                s.push_str(" | CUDA embedding backward: ordered index_add (slower)");
            }
        }
        s
    }
}

impl fmt::Display for PerfSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.header())
    }
}

/// The device as the run headers print it: `cpu`, `cuda:0` (PyTorch's names; candle's
/// `Debug` form is `Cpu` / `Cuda(CudaDevice(DeviceId(1)))`).
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".to_string(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Precision and device for a run header, e.g. `precision 32 (fp32) on cpu` or
/// `precision bf16-mixed (bf16 compute, fp32 masters) on cuda:0`.
pub fn precision_on_device(precision: crate::Precision, device: &Device) -> String {
    let what = match precision {
        crate::Precision::Fp32 => "fp32",
        crate::Precision::Bf16Mixed => "bf16 compute, fp32 masters",
        crate::Precision::F16Mixed => "f16 compute, fp32 masters, loss scaling",
    };
    format!("precision {precision} ({what}) on {}", device_name(device))
}

/// See [`PerfSettings::derive_seed`].
pub fn derive_seed(seed: u64, stream: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in stream.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let mut z = seed ^ h;
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_on_cpu_stores_the_seed_and_never_calls_candles_cpu_set_seed() {
        let p = PerfSettings {
            seed: 1234,
            tf32: true,
            reduced_precision_reductions: false,
            deterministic: true,
            pool_release_threshold: None,
        };
        p.apply(&Device::Cpu).unwrap();
        assert_eq!(global_seed(), Some(1234));
        assert!(deterministic());
        // candle itself refuses to seed the CPU device: apply must not forward it.
        assert!(Device::Cpu.set_seed(1).is_err());
    }

    #[test]
    fn header_names_every_setting() {
        let h = PerfSettings::fast(9).header();
        assert!(h.starts_with("perf: seed 9 | tf32 on | reduced-precision reductions off"));
        assert!(h.contains("deterministic off"));
        #[cfg(not(feature = "cuda"))]
        assert!(h.contains("no effect: CPU build"), "{h}");
        assert!(!PerfSettings::default().header().contains("no effect"));
        assert_eq!(
            format!("{}", PerfSettings::default()),
            PerfSettings::default().header()
        );
    }

    #[test]
    fn headers_name_precision_and_device_readably() {
        assert_eq!(device_name(&Device::Cpu), "cpu");
        assert_eq!(
            precision_on_device(crate::Precision::Fp32, &Device::Cpu),
            "precision 32 (fp32) on cpu"
        );
        let h = precision_on_device(crate::Precision::Bf16Mixed, &Device::Cpu);
        assert!(h.starts_with("precision bf16-mixed (bf16 compute") && h.ends_with(" on cpu"));
    }

    #[test]
    fn derived_seeds_are_stable_and_distinct() {
        let p = PerfSettings::fast(42);
        assert_eq!(p.derive_seed("loader"), derive_seed(42, "loader"));
        assert_ne!(p.derive_seed("loader"), p.derive_seed("params"));
        assert_ne!(derive_seed(1, "loader"), derive_seed(2, "loader"));
        // Pinned value: changing the derivation would silently change every seeded run.
        assert_eq!(derive_seed(42, "loader"), 3261162160711787615);
    }

    #[test]
    fn prepare_env_only_acts_when_deterministic() {
        assert!(PerfSettings::default().prepare_env().is_empty());
    }
}
