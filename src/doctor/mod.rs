//! `wick doctor`: what this machine and this build can do for training, and what to change.
//!
//! [`collect`] gathers the facts into a [`DoctorReport`] (serde-serialisable, so `--json`
//! prints it as is):
//! - host: OS, kernel, CPU model, cores, frequency governor (from
//!   `/sys/devices/system/cpu/cpu*/cpufreq/scaling_governor` where the kernel exposes it),
//!   memory (`/proc/meminfo`) and cgroup limits;
//! - GPUs through NVML (the `nvml-wrapper` crate opens `libnvidia-ml.so.1` at run time, so the
//!   binary runs on machines without a driver and reports that instead): name, compute
//!   capability, memory, driver and CUDA driver API versions, persistence mode, clocks, power,
//!   PCIe link, NVLink, throttle reasons, running processes (the `nvml` feature, default on;
//!   without it the report says NVML was not built in);
//! - the CUDA driver as CUDA itself sees it (`libcuda.so.1`: `cuInit`, device count; this
//!   honours `CUDA_VISIBLE_DEVICES`, NVML does not);
//! - the CUDA libraries that can actually be loaded (`dlopen`), with their versions;
//! - what this binary was built with (features, candle version, CUDA version and compute
//!   capability its kernels target).
//!
//! [`recommendations`] is a pure function of the report: each [`Recommendation`] says what was
//! found, why it matters and the exact command or setting. [`render_text`] prints both.
//! A [`Severity::Blocker`] means the requested device ([`Require`]) cannot be used; `wick
//! doctor` then exits non-zero.

use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::str::FromStr;

use crate::precision::Precision;

mod advice;
mod probe;
mod render;

pub use advice::{min_driver_for_cuda, ready, recommendations, verdict, DoctorOutput};
use probe::*;
pub use render::render_text;

/// NVML_NVLINK_MAX_LINKS of nvml.h.
#[cfg(feature = "nvml")]
const NVLINK_MAX_LINKS: u32 = 18;

/// The candle version wick is built and tested against (pinned with `=` in Cargo.toml).
pub const CANDLE_VERSION: &str = "0.11.1";

/// The device a user intends to train on (`wick doctor --require`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Require {
    /// A usable NVIDIA GPU with a build that has the `cuda` feature.
    Cuda,
    /// The CPU (always available).
    Cpu,
}

impl FromStr for Require {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cuda" | "gpu" => Ok(Require::Cuda),
            "cpu" => Ok(Require::Cpu),
            o => Err(format!(
                "unknown device {o:?}: expected \"cuda\" or \"cpu\""
            )),
        }
    }
}

/// Everything `wick doctor` found. Fields that could not be read are `None` (or empty).
#[derive(Debug, Clone, Default, Serialize)]
pub struct DoctorReport {
    /// Operating system and kernel.
    pub host: HostInfo,
    /// CPU model, cores, governor.
    pub cpu: CpuInfo,
    /// Host memory.
    pub memory: MemoryInfo,
    /// What this binary was built with.
    pub build: BuildInfo,
    /// NVML: driver-level view of the GPUs.
    pub nvml: NvmlInfo,
    /// One entry per GPU that NVML lists.
    pub gpus: Vec<GpuInfo>,
    /// The CUDA driver API as CUDA sees it (`libcuda.so.1`).
    pub cuda_driver: CudaDriverInfo,
    /// The CUDA libraries that a CUDA build loads, probed with `dlopen`.
    pub libraries: Vec<LibraryInfo>,
    /// Environment variables that change device selection or performance (only those set).
    pub env: BTreeMap<String, String>,
    /// The precision the user plans to train with (`--precision`), if given.
    #[serde(serialize_with = "ser_precision")]
    pub planned_precision: Option<Precision>,
    /// The device the user requires (`--require`), if given.
    pub require: Option<Require>,
}

fn ser_precision<S: serde::Serializer>(p: &Option<Precision>, s: S) -> Result<S::Ok, S::Error> {
    match p {
        Some(p) => s.serialize_some(&p.to_string()),
        None => s.serialize_none(),
    }
}

/// Operating system facts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct HostInfo {
    /// Host name.
    pub hostname: Option<String>,
    /// OS name (`PRETTY_NAME` of /etc/os-release, else the Rust target OS).
    pub os: String,
    /// Kernel release.
    pub kernel: Option<String>,
    /// CPU architecture.
    pub arch: String,
}

/// CPU facts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CpuInfo {
    /// Model name from /proc/cpuinfo.
    pub model: Option<String>,
    /// Logical CPUs this process may run on.
    pub logical_cores: usize,
    /// Physical cores (distinct physical id / core id pairs), where /proc/cpuinfo says.
    pub physical_cores: Option<usize>,
    /// CPU quota of the cgroup (cpu.max), in CPUs, when limited.
    pub cgroup_cpu_quota: Option<f64>,
    /// Frequency governor → number of CPUs using it; empty when cpufreq is not exposed
    /// (typical in VMs and containers).
    pub governors: BTreeMap<String, usize>,
    /// cpufreq scaling driver (intel_pstate, acpi-cpufreq, ...).
    pub scaling_driver: Option<String>,
    /// Highest frequency the CPU can reach, MHz (cpuinfo_max_freq).
    pub max_mhz: Option<f64>,
    /// Threads of rayon's global pool (the fused CPU optimizer path).
    pub rayon_threads: usize,
}

/// Host memory facts, bytes.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MemoryInfo {
    /// MemTotal.
    pub total_bytes: Option<u64>,
    /// MemAvailable.
    pub available_bytes: Option<u64>,
    /// SwapTotal.
    pub swap_total_bytes: Option<u64>,
    /// Memory limit of the cgroup (memory.max), when limited.
    pub cgroup_limit_bytes: Option<u64>,
}

/// What this binary was built with.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BuildInfo {
    /// wick's version.
    pub wick_version: String,
    /// candle's version.
    pub candle_version: String,
    /// `debug` or `release`.
    pub profile: String,
    /// The `cuda` feature.
    pub cuda: bool,
    /// The `nccl` feature.
    pub nccl: bool,
    /// The CUDA version the build targeted (`CUDARC_CUDA_VERSION` at build time), e.g. "13.0".
    pub cuda_version: Option<String>,
    /// The compute capability the kernels were compiled for (`CUDA_COMPUTE_CAP`), e.g. "90".
    pub compute_cap: Option<String>,
}

/// NVML status and system-wide versions.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NvmlInfo {
    /// NVML was loaded and initialised.
    pub loaded: bool,
    /// Why not, when it was not.
    pub error: Option<String>,
    /// NVIDIA driver version, e.g. "580.159.04".
    pub driver_version: Option<String>,
    /// Highest CUDA version the driver supports, e.g. "13.0".
    pub cuda_driver_version: Option<String>,
    /// NVML library version.
    pub nvml_version: Option<String>,
}

/// A compute capability, e.g. 9.0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct ComputeCapability {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl ComputeCapability {
    /// `major.minor` as one comparable number: 8.9 → 89.
    pub fn as_u32(self) -> u32 {
        self.major * 10 + self.minor
    }
}

impl std::fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Number formats that matter for training, by compute capability.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// bf16 tensor cores (compute capability >= 8.0).
    pub bf16: bool,
    /// TF32 tensor cores for f32 GEMMs (>= 8.0).
    pub tf32: bool,
    /// FP8 tensor cores (>= 8.9).
    pub fp8: bool,
}

impl Capabilities {
    /// The capabilities of a compute capability.
    pub fn of(cc: ComputeCapability) -> Self {
        let v = cc.as_u32();
        Capabilities {
            bf16: v >= 80,
            tf32: v >= 80,
            fp8: v >= 89,
        }
    }
}

/// A process using a GPU.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GpuProcess {
    /// Process id (the host's, which may be invisible from a container).
    pub pid: u32,
    /// Process name, where readable.
    pub name: Option<String>,
    /// GPU memory it holds, bytes.
    pub used_memory_bytes: Option<u64>,
    /// "compute" or "graphics".
    pub kind: String,
}

/// One GPU as NVML sees it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GpuInfo {
    /// NVML index (PCI order; CUDA's order may differ unless CUDA_DEVICE_ORDER=PCI_BUS_ID).
    pub index: u32,
    /// Product name.
    pub name: Option<String>,
    /// UUID.
    pub uuid: Option<String>,
    /// PCI bus id.
    pub pci_bus_id: Option<String>,
    /// Compute capability.
    pub compute_capability: Option<ComputeCapability>,
    /// Number formats with tensor-core support (all false when the capability is unknown).
    pub capabilities: Capabilities,
    /// Total device memory, bytes.
    pub memory_total_bytes: Option<u64>,
    /// Free device memory, bytes.
    pub memory_free_bytes: Option<u64>,
    /// Persistence mode.
    pub persistence_mode: Option<bool>,
    /// Current SM clock, MHz.
    pub sm_clock_mhz: Option<u32>,
    /// Highest SM clock, MHz.
    pub max_sm_clock_mhz: Option<u32>,
    /// Current memory clock, MHz.
    pub mem_clock_mhz: Option<u32>,
    /// Highest memory clock, MHz.
    pub max_mem_clock_mhz: Option<u32>,
    /// Power limit in force, W.
    pub power_limit_w: Option<f64>,
    /// Default power limit, W.
    pub default_power_limit_w: Option<f64>,
    /// Current draw, W.
    pub power_usage_w: Option<f64>,
    /// Temperature, °C.
    pub temperature_c: Option<u32>,
    /// GPU utilisation, % of the last sample period with a kernel running.
    pub utilization_pct: Option<u32>,
    /// Current PCIe generation.
    pub pcie_gen: Option<u32>,
    /// Highest PCIe generation of the link.
    pub pcie_max_gen: Option<u32>,
    /// Current PCIe width (lanes).
    pub pcie_width: Option<u32>,
    /// Highest PCIe width.
    pub pcie_max_width: Option<u32>,
    /// Active NVLink links (None: not readable or no NVLink).
    pub nvlink_active: Option<u32>,
    /// NVLink links that report a state.
    pub nvlink_links: Option<u32>,
    /// Reasons the clocks are held down right now (idle is normal).
    pub throttle_reasons: Vec<String>,
    /// Processes using the GPU.
    pub processes: Vec<GpuProcess>,
    /// Queries that failed for a reason other than "not supported".
    pub errors: Vec<String>,
}

/// The CUDA driver library as CUDA sees the GPUs.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CudaDriverInfo {
    /// `libcuda.so.1` could be loaded.
    pub loaded: bool,
    /// CUDA version the driver supports (`cuDriverGetVersion`), e.g. "13.0".
    pub version: Option<String>,
    /// Result of `cuInit(0)`: "CUDA_SUCCESS" or the error name.
    pub init: Option<String>,
    /// Devices CUDA can use (after CUDA_VISIBLE_DEVICES).
    pub device_count: Option<u32>,
    /// Why the library could not be loaded.
    pub error: Option<String>,
}

/// One shared library probed with `dlopen`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LibraryInfo {
    /// Library name (cuBLAS, NCCL, ...).
    pub name: String,
    /// The file name asked for (soname).
    pub soname: String,
    /// It could be loaded.
    pub found: bool,
    /// Where it was loaded from.
    pub path: Option<String>,
    /// Its version, where the library exports a version function.
    pub version: Option<String>,
    /// Why it could not be loaded.
    pub error: Option<String>,
    /// What needs it.
    pub needed_by: String,
}

/// How much a recommendation matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The required device cannot be used: `wick doctor` exits non-zero.
    Blocker,
    /// Costs speed or risks failures; fix before long runs.
    Warning,
    /// A setting worth knowing about.
    Tip,
}

/// One finding with the reason and the exact command or setting.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recommendation {
    /// Stable identifier (`cpu-governor`, `persistence-mode`, `use-bf16`, ...).
    pub id: &'static str,
    /// How much it matters.
    pub severity: Severity,
    /// What was found.
    pub finding: String,
    /// Why it matters.
    pub reason: String,
    /// The exact command or setting.
    pub action: String,
}

// ---------------------------------------------------------------------------------------------
// Collection
// ---------------------------------------------------------------------------------------------

/// Gathers the report. Never fails: what cannot be read is recorded as `None` or as an error
/// string. Probed CUDA libraries stay loaded for the life of the process (unloading driver
/// libraries is unsafe in general).
pub fn collect() -> DoctorReport {
    let nvml = collect_nvml();
    DoctorReport {
        host: collect_host(),
        cpu: collect_cpu(),
        memory: collect_memory(),
        build: build_info(),
        nvml: nvml.0,
        gpus: nvml.1,
        cuda_driver: probe_cuda_driver(),
        libraries: probe_libraries(),
        env: collect_env(),
        planned_precision: None,
        require: None,
    }
}

impl DoctorReport {
    /// Records what the user intends: the precision and the device (used by
    /// [`recommendations`]).
    pub fn with_intent(mut self, precision: Option<Precision>, require: Option<Require>) -> Self {
        self.planned_precision = precision;
        self.require = require;
        self
    }

    /// GPUs that CUDA can open: `cuInit` succeeded and `cuDeviceGetCount` (which honours
    /// `CUDA_VISIBLE_DEVICES`) counted them.
    pub fn usable_gpus(&self) -> usize {
        if self.cuda_driver.init.as_deref() == Some("CUDA_SUCCESS") {
            self.cuda_driver.device_count.unwrap_or(0) as usize
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(cc: (u32, u32)) -> GpuInfo {
        let cc = ComputeCapability {
            major: cc.0,
            minor: cc.1,
        };
        GpuInfo {
            index: 0,
            name: Some("Test GPU".into()),
            compute_capability: Some(cc),
            capabilities: Capabilities::of(cc),
            memory_total_bytes: Some(80 << 30),
            memory_free_bytes: Some(79 << 30),
            persistence_mode: Some(true),
            ..Default::default()
        }
    }

    /// A healthy release CUDA build with one GPU that CUDA can open.
    fn cuda_report(g: GpuInfo) -> DoctorReport {
        DoctorReport {
            build: BuildInfo {
                profile: "release".into(),
                cuda: true,
                cuda_version: Some("13.0".into()),
                compute_cap: Some(format!(
                    "{}",
                    g.compute_capability.map(|c| c.as_u32()).unwrap_or(90)
                )),
                ..Default::default()
            },
            nvml: NvmlInfo {
                loaded: true,
                driver_version: Some("580.159.04".into()),
                cuda_driver_version: Some("13.0".into()),
                ..Default::default()
            },
            cuda_driver: CudaDriverInfo {
                loaded: true,
                version: Some("13.0".into()),
                init: Some("CUDA_SUCCESS".into()),
                device_count: Some(1),
                error: None,
            },
            gpus: vec![g],
            planned_precision: Some(Precision::Bf16Mixed),
            ..Default::default()
        }
    }

    fn ids(r: &DoctorReport) -> Vec<&'static str> {
        recommendations(r).iter().map(|x| x.id).collect()
    }

    #[test]
    fn healthy_machine_has_no_findings() {
        let r =
            cuda_report(gpu((9, 0))).with_intent(Some(Precision::Bf16Mixed), Some(Require::Cuda));
        let recs = recommendations(&r);
        assert!(recs.is_empty(), "{recs:#?}");
        assert!(ready(&recs));
        assert!(verdict(&r, &recs).starts_with("ready: CUDA training on 1 GPU"));
    }

    #[test]
    fn powersave_governor_is_flagged_with_the_cpupower_command() {
        let mut r = DoctorReport::default();
        r.build.profile = "release".into();
        r.cpu.governors.insert("powersave".into(), 8);
        let recs = recommendations(&r);
        let g = recs
            .iter()
            .find(|x| x.id == "cpu-governor")
            .expect("governor recommendation");
        assert_eq!(g.severity, Severity::Warning);
        assert!(g.finding.contains("powersave on 8 CPU(s)"));
        assert!(g
            .action
            .contains("sudo cpupower frequency-set -g performance"));
        // performance → nothing; no cpufreq at all → nothing.
        r.cpu.governors = [("performance".to_string(), 8)].into();
        assert!(!ids(&r).contains(&"cpu-governor"));
        r.cpu.governors.clear();
        assert!(!ids(&r).contains(&"cpu-governor"));
    }

    #[test]
    fn cc80_gpu_without_bf16_gets_the_bf16_recommendation() {
        for planned in [None, Some(Precision::Fp32), Some(Precision::F16Mixed)] {
            let mut r = cuda_report(gpu((8, 0)));
            r.planned_precision = planned;
            let recs = recommendations(&r);
            let b = recs
                .iter()
                .find(|x| x.id == "use-bf16")
                .expect("bf16 recommendation");
            assert!(b.action.contains("--precision bf16-mixed"), "{b:?}");
        }
        let mut r = cuda_report(gpu((8, 0)));
        r.planned_precision = Some(Precision::Fp32);
        assert!(ids(&r).contains(&"use-tf32"));
    }

    #[test]
    fn cc70_gpu_makes_no_bf16_claim() {
        let g = gpu((7, 0));
        assert_eq!(
            g.capabilities,
            Capabilities {
                bf16: false,
                tf32: false,
                fp8: false
            }
        );
        for planned in [None, Some(Precision::Fp32), Some(Precision::F16Mixed)] {
            let mut r = cuda_report(g.clone());
            r.planned_precision = planned;
            let recs = recommendations(&r);
            assert!(
                recs.iter()
                    .all(|x| !x.action.contains("bf16") && x.id != "use-tf32"),
                "{recs:#?}"
            );
        }
        let mut r = cuda_report(g);
        r.planned_precision = Some(Precision::Bf16Mixed);
        let recs = recommendations(&r);
        let w = recs.iter().find(|x| x.id == "bf16-unsupported").unwrap();
        assert!(w.action.contains("16-mixed"));
    }

    #[test]
    fn fp8_needs_cc89() {
        assert!(!Capabilities::of(ComputeCapability { major: 8, minor: 6 }).fp8);
        assert!(Capabilities::of(ComputeCapability { major: 8, minor: 9 }).fp8);
        assert!(Capabilities::of(ComputeCapability { major: 9, minor: 0 }).fp8);
    }

    #[test]
    fn persistence_off_is_flagged() {
        let mut g = gpu((9, 0));
        g.persistence_mode = Some(false);
        let recs = recommendations(&cuda_report(g));
        let p = recs.iter().find(|x| x.id == "persistence-mode").unwrap();
        assert!(p.action.contains("sudo nvidia-smi -i 0 -pm 1"));
    }

    #[test]
    fn busy_gpu_names_the_processes() {
        let mut g = gpu((9, 0));
        g.processes.push(GpuProcess {
            pid: 4242,
            name: Some("python".into()),
            used_memory_bytes: Some(20 << 30),
            kind: "compute".into(),
        });
        let recs = recommendations(&cuda_report(g));
        let b = recs.iter().find(|x| x.id == "gpu-busy").unwrap();
        assert!(
            b.finding.contains("pid 4242 python 20.0 GiB"),
            "{}",
            b.finding
        );
    }

    #[test]
    fn old_driver_for_a_cuda13_build_is_a_blocker_when_cuda_is_required() {
        let mut r = cuda_report(gpu((9, 0)));
        r.nvml.driver_version = Some("550.54.14".into());
        r.nvml.cuda_driver_version = Some("12.4".into());
        r.require = Some(Require::Cuda);
        let recs = recommendations(&r);
        let d = recs.iter().find(|x| x.id == "driver-too-old").unwrap();
        assert_eq!(d.severity, Severity::Blocker);
        assert!(d.action.contains(">= 580.65.06"), "{}", d.action);
        assert!(!ready(&recs));
        r.require = None;
        assert!(ready(&recommendations(&r)));
    }

    #[test]
    fn no_gpu_blocks_only_when_cuda_is_required() {
        let mut r = DoctorReport::default();
        r.build.profile = "release".into();
        r.nvml.error = Some("libnvidia-ml.so.1 not loadable".into());
        assert!(ready(&recommendations(&r)));
        assert!(verdict(&r, &recommendations(&r)).contains("no NVIDIA GPU"));
        r.require = Some(Require::Cpu);
        assert!(ready(&recommendations(&r)));
        r.require = Some(Require::Cuda);
        let recs = recommendations(&r);
        assert!(!ready(&recs));
        let found: Vec<_> = recs.iter().map(|x| x.id).collect();
        assert!(
            found.contains(&"build-without-cuda") && found.contains(&"no-gpu"),
            "{found:?}"
        );
        assert!(verdict(&r, &recs).starts_with("NOT READY for CUDA training"));
        // A cuda build on a GPU-less machine: warned, not blocked, unless required.
        r.require = None;
        r.build.cuda = true;
        let recs = recommendations(&r);
        assert!(ready(&recs) && recs.iter().any(|x| x.id == "no-gpu"));
    }

    #[test]
    fn kernels_for_sm90a_do_not_load_on_other_gpus() {
        let mut r = cuda_report(gpu((8, 0)));
        r.build.compute_cap = Some("90".into());
        let recs = recommendations(&r);
        let m = recs
            .iter()
            .find(|x| x.id == "compute-cap-mismatch")
            .unwrap();
        assert!(m.action.contains("CUDA_COMPUTE_CAP=80"));
    }

    #[test]
    fn text_and_json_render_a_real_collection() {
        let r = collect();
        let recs = recommendations(&r);
        let t = render_text(&r, &recs);
        for section in [
            "system",
            "build",
            "GPUs",
            "CUDA libraries",
            "recommendations",
        ] {
            assert!(t.contains(section), "{t}");
        }
        let j = serde_json::to_value(DoctorOutput {
            report: &r,
            recommendations: &recs,
            ready: ready(&recs),
            verdict: verdict(&r, &recs),
        })
        .unwrap();
        assert!(j["report"]["libraries"].as_array().unwrap().len() == LIBRARIES.len());
    }

    #[test]
    fn version_strings() {
        assert_eq!(cuda_version_string(13000), "13.0");
        assert_eq!(cuda_version_string(12040), "12.4");
        assert_eq!(parse_major_minor("13.0"), Some((13, 0)));
        assert_eq!(min_driver_for_cuda(13, 0), Some("580.65.06"));
    }
}
