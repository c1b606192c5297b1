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
//!   PCIe link, NVLink, throttle reasons, running processes;
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

/// NVML_NVLINK_MAX_LINKS of nvml.h.
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

fn read_trim(p: impl AsRef<Path>) -> Option<String> {
    fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn collect_host() -> HostInfo {
    let os = read_trim("/etc/os-release")
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("PRETTY_NAME=")
                    .map(|v| v.trim_matches('"').to_string())
            })
        })
        .unwrap_or_else(|| std::env::consts::OS.to_string());
    HostInfo {
        hostname: read_trim("/proc/sys/kernel/hostname"),
        os,
        kernel: read_trim("/proc/sys/kernel/osrelease"),
        arch: std::env::consts::ARCH.to_string(),
    }
}

fn collect_cpu() -> CpuInfo {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |l: &str| l.split_once(':').map(|(_, v)| v.trim().to_string());
    let model = cpuinfo
        .lines()
        .find(|l| {
            l.starts_with("model name") || l.starts_with("Model") || l.starts_with("Hardware")
        })
        .and_then(field);
    let mut cores = std::collections::BTreeSet::new();
    let mut phys = None;
    for l in cpuinfo.lines() {
        if l.starts_with("physical id") {
            phys = field(l);
        } else if l.starts_with("core id") {
            cores.insert((phys.clone(), field(l)));
        }
    }
    let mut governors = BTreeMap::new();
    let mut scaling_driver = None;
    let mut max_mhz: Option<f64> = None;
    if let Ok(rd) = fs::read_dir("/sys/devices/system/cpu") {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let is_cpu = name.len() > 3
                && name.starts_with("cpu")
                && name[3..].bytes().all(|b| b.is_ascii_digit());
            if !is_cpu {
                continue;
            }
            let dir = e.path().join("cpufreq");
            if let Some(g) = read_trim(dir.join("scaling_governor")) {
                *governors.entry(g).or_insert(0) += 1;
            }
            if scaling_driver.is_none() {
                scaling_driver = read_trim(dir.join("scaling_driver"));
            }
            if let Some(khz) =
                read_trim(dir.join("cpuinfo_max_freq")).and_then(|s| s.parse::<f64>().ok())
            {
                max_mhz = Some(max_mhz.unwrap_or(0.0).max(khz / 1e3));
            }
        }
    }
    let cgroup_cpu_quota = read_trim("/sys/fs/cgroup/cpu.max").and_then(|s| {
        let mut it = s.split_whitespace();
        let (q, p) = (it.next()?, it.next()?);
        let (q, p) = (q.parse::<f64>().ok()?, p.parse::<f64>().ok()?);
        (p > 0.0).then_some(q / p)
    });
    CpuInfo {
        model,
        logical_cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        physical_cores: (!cores.is_empty()).then_some(cores.len()),
        cgroup_cpu_quota,
        governors,
        scaling_driver,
        max_mhz,
        rayon_threads: rayon::current_num_threads(),
    }
}

fn collect_memory() -> MemoryInfo {
    let meminfo = fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kb = |key: &str| {
        meminfo.lines().find_map(|l| {
            let rest = l.strip_prefix(key)?.strip_prefix(':')?;
            let n: u64 = rest.split_whitespace().next()?.parse().ok()?;
            Some(n * 1024)
        })
    };
    MemoryInfo {
        total_bytes: kb("MemTotal"),
        available_bytes: kb("MemAvailable"),
        swap_total_bytes: kb("SwapTotal"),
        cgroup_limit_bytes: read_trim("/sys/fs/cgroup/memory.max").and_then(|s| s.parse().ok()),
    }
}

fn build_info() -> BuildInfo {
    BuildInfo {
        wick_version: env!("CARGO_PKG_VERSION").to_string(),
        candle_version: CANDLE_VERSION.to_string(),
        profile: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
        .to_string(),
        cuda: cfg!(feature = "cuda"),
        nccl: cfg!(feature = "nccl"),
        cuda_version: if cfg!(feature = "cuda") {
            option_env!("CUDARC_CUDA_VERSION")
                .and_then(|v| v.trim().parse::<i64>().ok())
                .map(cuda_version_string)
        } else {
            None
        },
        compute_cap: if cfg!(feature = "cuda") {
            // build.rs and candle-kernels default to 90 when CUDA_COMPUTE_CAP is unset.
            Some(option_env!("CUDA_COMPUTE_CAP").unwrap_or("90").to_string())
        } else {
            None
        },
    }
}

fn collect_env() -> BTreeMap<String, String> {
    [
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "CUBLAS_WORKSPACE_CONFIG",
        "RAYON_NUM_THREADS",
        "NCCL_DEBUG",
        "NCCL_NVLS_ENABLE",
        "NCCL_P2P_DISABLE",
        "NCCL_IB_DISABLE",
    ]
    .iter()
    .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
    .collect()
}

/// 13000 → "13.0"; 12040 → "12.4".
fn cuda_version_string(v: i64) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// "13.0" → (13, 0).
fn parse_major_minor(s: &str) -> Option<(u32, u32)> {
    let mut it = s.split('.');
    Some((
        it.next()?.trim().parse().ok()?,
        it.next().unwrap_or("0").trim().parse().ok()?,
    ))
}

fn collect_nvml() -> (NvmlInfo, Vec<GpuInfo>) {
    use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
    use nvml_wrapper::error::NvmlError;
    use nvml_wrapper::Nvml;
    use std::ffi::OsStr;

    // Distributions ship the versioned name; the unversioned one comes with -dev packages.
    let nvml = Nvml::builder()
        .lib_path(OsStr::new("libnvidia-ml.so.1"))
        .init()
        .or_else(|_| Nvml::init());
    let nvml = match nvml {
        Ok(n) => n,
        Err(e) => {
            let error = match e {
                NvmlError::LibloadingError(le) => format!(
                    "no NVIDIA driver on this machine (NVML: {})",
                    first_line(&le.to_string())
                ),
                NvmlError::DriverNotLoaded => {
                    "NVML is installed but the NVIDIA kernel driver is not loaded".to_string()
                }
                NvmlError::NoPermission => "no permission to talk to the NVIDIA driver".to_string(),
                other => format!("NVML initialisation failed: {other}"),
            };
            return (
                NvmlInfo {
                    loaded: false,
                    error: Some(error),
                    ..Default::default()
                },
                Vec::new(),
            );
        }
    };
    let info = NvmlInfo {
        loaded: true,
        error: None,
        driver_version: nvml.sys_driver_version().ok(),
        cuda_driver_version: nvml
            .sys_cuda_driver_version()
            .ok()
            .map(|v| cuda_version_string(v as i64)),
        nvml_version: nvml.sys_nvml_version().ok(),
    };
    let count = match nvml.device_count() {
        Ok(c) => c,
        Err(e) => {
            let mut info = info;
            info.error = Some(format!("nvmlDeviceGetCount failed: {e}"));
            return (info, Vec::new());
        }
    };
    let mut gpus = Vec::new();
    for index in 0..count {
        let mut g = GpuInfo {
            index,
            ..Default::default()
        };
        let dev = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                g.errors.push(format!("device handle: {e}"));
                gpus.push(g);
                continue;
            }
        };
        let mut errors = Vec::new();
        macro_rules! ok {
            ($what:expr, $r:expr) => {
                keep(&mut errors, $what, $r)
            };
        }
        g.name = ok!("name", dev.name());
        g.uuid = ok!("uuid", dev.uuid());
        g.pci_bus_id = ok!("pci", dev.pci_info()).map(|p| p.bus_id);
        g.compute_capability =
            ok!("compute capability", dev.cuda_compute_capability()).map(|c| ComputeCapability {
                major: c.major.max(0) as u32,
                minor: c.minor.max(0) as u32,
            });
        g.capabilities = g
            .compute_capability
            .map(Capabilities::of)
            .unwrap_or_default();
        if let Some(m) = ok!("memory", dev.memory_info()) {
            g.memory_total_bytes = Some(m.total);
            g.memory_free_bytes = Some(m.free);
        }
        g.persistence_mode = ok!("persistence mode", dev.is_in_persistent_mode());
        g.sm_clock_mhz = ok!("sm clock", dev.clock_info(Clock::SM));
        g.max_sm_clock_mhz = ok!("max sm clock", dev.max_clock_info(Clock::SM));
        g.mem_clock_mhz = ok!("memory clock", dev.clock_info(Clock::Memory));
        g.max_mem_clock_mhz = ok!("max memory clock", dev.max_clock_info(Clock::Memory));
        g.power_limit_w = ok!("power limit", dev.enforced_power_limit()).map(|mw| mw as f64 / 1e3);
        g.default_power_limit_w = ok!("default power limit", dev.power_management_limit_default())
            .map(|mw| mw as f64 / 1e3);
        g.power_usage_w = ok!("power usage", dev.power_usage()).map(|mw| mw as f64 / 1e3);
        g.temperature_c = ok!("temperature", dev.temperature(TemperatureSensor::Gpu));
        g.utilization_pct = ok!("utilization", dev.utilization_rates()).map(|u| u.gpu);
        g.pcie_gen = ok!("pcie gen", dev.current_pcie_link_gen());
        g.pcie_max_gen = ok!("pcie max gen", dev.max_pcie_link_gen());
        g.pcie_width = ok!("pcie width", dev.current_pcie_link_width());
        g.pcie_max_width = ok!("pcie max width", dev.max_pcie_link_width());
        if let Some(t) = ok!("throttle reasons", dev.current_throttle_reasons()) {
            g.throttle_reasons = t
                .iter_names()
                .map(|(n, _)| n.to_ascii_lowercase())
                .filter(|n| n != "none")
                .collect();
        }
        // NVLink: links that answer is_active; unsupported links answer NotSupported.
        let (mut links, mut active) = (0u32, 0u32);
        for l in 0..NVLINK_MAX_LINKS {
            if let Ok(a) = dev.link_wrapper_for(l).is_active() {
                links += 1;
                active += a as u32;
            }
        }
        if links > 0 {
            g.nvlink_links = Some(links);
            g.nvlink_active = Some(active);
        }
        let mut procs = Vec::new();
        for (kind, list) in [
            (
                "compute",
                ok!("compute processes", dev.running_compute_processes()),
            ),
            (
                "graphics",
                ok!("graphics processes", dev.running_graphics_processes()),
            ),
        ] {
            for p in list.unwrap_or_default() {
                procs.push(GpuProcess {
                    pid: p.pid,
                    name: None,
                    used_memory_bytes: match p.used_gpu_memory {
                        nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
                        nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                    },
                    kind: kind.to_string(),
                });
            }
        }
        g.errors = errors;
        for p in &mut procs {
            p.name = nvml
                .sys_process_name(p.pid, 64)
                .ok()
                .filter(|s| !s.is_empty())
                .or_else(|| read_trim(format!("/proc/{}/comm", p.pid)));
        }
        g.processes = procs;
        gpus.push(g);
    }
    (info, gpus)
}

/// Keeps a value; records the failure unless the GPU simply lacks the feature.
fn keep<T>(
    errors: &mut Vec<String>,
    what: &str,
    r: Result<T, nvml_wrapper::error::NvmlError>,
) -> Option<T> {
    use nvml_wrapper::error::NvmlError;
    match r {
        Ok(v) => Some(v),
        Err(NvmlError::NotSupported) | Err(NvmlError::FunctionNotFound) => None,
        Err(e) => {
            errors.push(format!("{what}: {e}"));
            None
        }
    }
}

/// Loads a library and keeps it loaded (see [`collect`]).
fn load(soname: &str) -> Result<&'static libloading::Library, String> {
    // SAFETY: loading runs the library's initialisers; these are NVIDIA's own libraries,
    // which are designed to be dlopen'ed (CUDA applications and PyTorch do so).
    match unsafe { libloading::Library::new(soname) } {
        Ok(lib) => Ok(Box::leak(Box::new(lib))),
        Err(e) => Err(first_line(&e.to_string())),
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

/// The file a loaded library was mapped from, found in /proc/self/maps.
fn mapped_path(soname: &str) -> Option<String> {
    let maps = fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .is_some_and(|f| f.to_string_lossy().starts_with(soname))
        })
        .map(str::to_string)
}

type IntOut = unsafe extern "C" fn(*mut std::os::raw::c_int) -> std::os::raw::c_int;

/// Calls `f(int*) -> status` and returns the int when status is 0.
fn call_int_out(lib: &libloading::Library, sym: &[u8]) -> Option<i64> {
    // SAFETY: the symbol has this C signature in every version of the library it is asked of
    // (cuDriverGetVersion, cudaRuntimeGetVersion, curandGetVersion, ncclGetVersion); none
    // needs an initialised context.
    unsafe {
        let f = lib.get::<IntOut>(sym).ok()?;
        let mut v: std::os::raw::c_int = 0;
        (f(&mut v) == 0).then_some(v as i64)
    }
}

fn library_version(name: &str, lib: &libloading::Library) -> Option<String> {
    use std::os::raw::c_int;
    match name {
        "CUDA runtime" => call_int_out(lib, b"cudaRuntimeGetVersion\0").map(cuda_version_string),
        "cuRAND" => call_int_out(lib, b"curandGetVersion\0")
            .map(|v| format!("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100)),
        "NCCL" => call_int_out(lib, b"ncclGetVersion\0")
            .map(|v| format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)),
        "NVRTC" => unsafe {
            // SAFETY: nvrtcResult nvrtcVersion(int *major, int *minor).
            type F = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
            let f = lib.get::<F>(b"nvrtcVersion\0").ok()?;
            let (mut a, mut b) = (0, 0);
            (f(&mut a, &mut b) == 0).then(|| format!("{a}.{b}"))
        },
        "cuBLAS" => unsafe {
            // SAFETY: cublasStatus_t cublasGetProperty(libraryPropertyType, int *); no handle.
            type F = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
            let f = lib.get::<F>(b"cublasGetProperty\0").ok()?;
            let mut parts = [0; 3];
            for (k, p) in parts.iter_mut().enumerate() {
                if f(k as c_int, p) != 0 {
                    return None;
                }
            }
            Some(format!("{}.{}.{}", parts[0], parts[1], parts[2]))
        },
        "cuBLASLt" => unsafe {
            // SAFETY: size_t cublasLtGetVersion(void).
            type F = unsafe extern "C" fn() -> usize;
            let f = lib.get::<F>(b"cublasLtGetVersion\0").ok()?;
            let v = f();
            Some(format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
        },
        "cuDNN" => unsafe {
            // SAFETY: size_t cudnnGetVersion(void); 9.x encodes major*10000 + minor*100 + patch.
            type F = unsafe extern "C" fn() -> usize;
            let f = lib.get::<F>(b"cudnnGetVersion\0").ok()?;
            let v = f();
            Some(format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
        },
        _ => None,
    }
}

/// The libraries a CUDA build of wick (candle 0.11.1 on CUDA 13) loads, and what needs them.
const LIBRARIES: &[(&str, &str, &str)] = &[
    (
        "CUDA runtime",
        "libcudart.so.13",
        "cuda build (candle kernels)",
    ),
    ("cuBLAS", "libcublas.so.13", "cuda build (matmul)"),
    ("cuBLASLt", "libcublasLt.so.13", "cuda build (matmul)"),
    ("cuRAND", "libcurand.so.10", "cuda build (random init)"),
    ("NVRTC", "libnvrtc.so.13", "cuda build (run-time kernels)"),
    ("NCCL", "libnccl.so.2", "nccl build (multi-GPU)"),
    ("cuDNN", "libcudnn.so.9", "optional (not used by wick)"),
];

fn probe_libraries() -> Vec<LibraryInfo> {
    LIBRARIES
        .iter()
        .map(|(name, soname, needed_by)| {
            let mut info = LibraryInfo {
                name: name.to_string(),
                soname: soname.to_string(),
                needed_by: needed_by.to_string(),
                ..Default::default()
            };
            match load(soname) {
                Ok(lib) => {
                    info.found = true;
                    info.version = library_version(name, lib);
                    info.path = mapped_path(soname);
                }
                Err(e) => info.error = Some(e),
            }
            info
        })
        .collect()
}

/// A CUresult as its name, through `cuGetErrorName` when the library has it.
fn cu_error_name(lib: &libloading::Library, code: i32) -> String {
    type F = unsafe extern "C" fn(std::os::raw::c_int, *mut *const std::os::raw::c_char) -> i32;
    // SAFETY: CUresult cuGetErrorName(CUresult, const char **); the string is static.
    let named = unsafe {
        lib.get::<F>(b"cuGetErrorName\0").ok().and_then(|f| {
            let mut p: *const std::os::raw::c_char = std::ptr::null();
            (f(code, &mut p) == 0 && !p.is_null())
                .then(|| std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned())
        })
    };
    named.unwrap_or_else(|| {
        match code {
            3 => "CUDA_ERROR_NOT_INITIALIZED",
            34 => "CUDA_ERROR_STUB_LIBRARY",
            35 => "CUDA_ERROR_INSUFFICIENT_DRIVER",
            46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
            100 => "CUDA_ERROR_NO_DEVICE",
            101 => "CUDA_ERROR_INVALID_DEVICE",
            804 => "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
            999 => "CUDA_ERROR_UNKNOWN",
            _ => return format!("CUresult {code}"),
        }
        .to_string()
    })
}

fn probe_cuda_driver() -> CudaDriverInfo {
    let lib = match load("libcuda.so.1") {
        Ok(l) => l,
        Err(e) => {
            return CudaDriverInfo {
                loaded: false,
                error: Some(e),
                ..Default::default()
            }
        }
    };
    let mut info = CudaDriverInfo {
        loaded: true,
        version: call_int_out(lib, b"cuDriverGetVersion\0").map(cuda_version_string),
        ..Default::default()
    };
    type Init = unsafe extern "C" fn(std::os::raw::c_uint) -> i32;
    // SAFETY: CUresult cuInit(unsigned int flags); flags must be 0. Idempotent.
    let init = unsafe { lib.get::<Init>(b"cuInit\0").ok().map(|f| f(0)) };
    match init {
        Some(0) => {
            info.init = Some("CUDA_SUCCESS".to_string());
            info.device_count = call_int_out(lib, b"cuDeviceGetCount\0").map(|n| n.max(0) as u32);
        }
        Some(code) => {
            info.init = Some(cu_error_name(lib, code));
            info.device_count = Some(0);
        }
        None => info.error = Some("libcuda.so.1 has no cuInit".to_string()),
    }
    info
}

// ---------------------------------------------------------------------------------------------
// Recommendations
// ---------------------------------------------------------------------------------------------

/// The lowest Linux driver for a CUDA version (NVIDIA's CUDA toolkit release notes, table 3).
pub fn min_driver_for_cuda(major: u32, minor: u32) -> Option<&'static str> {
    Some(match (major, minor) {
        (13, _) => "580.65.06",
        (12, 9) => "575.51.03",
        (12, 8) => "570.26",
        (12, 6) => "560.28.03",
        (12, 5) => "555.42.02",
        (12, 4) => "550.54.14",
        (12, 3) => "545.23.06",
        (12, 2) => "535.54.03",
        (12, 1) => "530.30.02",
        (12, _) => "525.60.13",
        (11, 8) => "520.61.05",
        _ => return None,
    })
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// What to do about this report, most severe first. Pure: depends only on the report.
pub fn recommendations(r: &DoctorReport) -> Vec<Recommendation> {
    let mut out = Vec::new();
    let mut add = |id, severity, finding: String, reason: &str, action: String| {
        out.push(Recommendation {
            id,
            severity,
            finding,
            reason: reason.to_string(),
            action,
        })
    };
    let want_cuda = r.require == Some(Require::Cuda);
    let gpu_sev = if want_cuda {
        Severity::Blocker
    } else {
        Severity::Warning
    };
    let cuda_sees = r.cuda_driver.init.as_deref() == Some("CUDA_SUCCESS")
        && r.cuda_driver.device_count.unwrap_or(0) > 0;
    let any_gpu = !r.gpus.is_empty() || cuda_sees;

    // --- build ----------------------------------------------------------------------------
    if r.build.profile == "debug" {
        add(
            "debug-build",
            Severity::Warning,
            "this is a debug build of wick".into(),
            "unoptimised Rust is 10-50x slower on the CPU paths (data loading, fused CPU optimizer, host-side graph work)",
            "cargo build --release (and run target/release/wick)".into(),
        );
    }
    if !r.build.cuda && (want_cuda || any_gpu) {
        let found = if any_gpu {
            format!("{} NVIDIA GPU(s) present, but", r.gpus.len().max(1))
        } else {
            "".into()
        };
        add(
            "build-without-cuda",
            gpu_sev,
            format!("{found} this binary was built without the `cuda` feature").trim().to_string(),
            "a CPU-only build cannot use a GPU; candle's CUDA backend and wick's kernels are compiled only with the feature",
            "source /opt/cuda13/env.sh && cargo build --release --features cuda   (CUDA 13 toolchain: see the README)".into(),
        );
    }

    // --- no GPU / driver ---------------------------------------------------------------------
    if !any_gpu {
        let mut why = r
            .nvml
            .error
            .clone()
            .unwrap_or_else(|| "NVML lists no GPU".into());
        if let Some(init) = r
            .cuda_driver
            .init
            .as_deref()
            .filter(|i| *i != "CUDA_SUCCESS")
        {
            why.push_str(&format!("; cuInit → {init}"));
        }
        let (sev, reason) = if want_cuda {
            (
                Severity::Blocker,
                "--require cuda needs a GPU that the CUDA driver can open",
            )
        } else if r.build.cuda {
            (
                Severity::Warning,
                "this build has CUDA, but training will run on the CPU",
            )
        } else {
            (
                Severity::Tip,
                "training runs on the CPU (the fused CPU optimizer path, rayon)",
            )
        };
        add(
            "no-gpu",
            sev,
            format!("no usable NVIDIA GPU found: {why}"),
            reason,
            "for GPU training: a machine with an NVIDIA GPU and driver >= 580 (CUDA 13) and a `--features cuda` build; here: train with --device cpu".into(),
        );
    }
    if !r.gpus.is_empty() && r.cuda_driver.loaded && !cuda_sees {
        let init = r
            .cuda_driver
            .init
            .clone()
            .unwrap_or_else(|| "no answer".into());
        let hidden = r
            .env
            .get("CUDA_VISIBLE_DEVICES")
            .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})"))
            .unwrap_or_default();
        add(
            "cuda-init",
            gpu_sev,
            format!(
                "NVML lists {} GPU(s) but CUDA sees none: cuInit → {init}{hidden}",
                r.gpus.len()
            ),
            "CUDA applications see only what cuInit and CUDA_VISIBLE_DEVICES allow",
            if hidden.is_empty() {
                "check the driver installation (nvidia-smi; dmesg | grep -i nvrm) and the container's GPU access (--gpus all)".into()
            } else {
                "unset CUDA_VISIBLE_DEVICES or set it to a GPU index, e.g. export CUDA_VISIBLE_DEVICES=0".into()
            },
        );
    }
    if any_gpu && !r.cuda_driver.loaded && r.build.cuda {
        add(
            "no-libcuda",
            gpu_sev,
            "libcuda.so.1 (the CUDA driver library) is not loadable".into(),
            "every CUDA program needs the driver's libcuda.so.1",
            "install the NVIDIA driver's CUDA library or add its folder to LD_LIBRARY_PATH (e.g. /usr/local/nvidia/lib64)".into(),
        );
    }
    // The driver must support the CUDA version the binary (and its PTX) was built for.
    let driver_cuda = r
        .nvml
        .cuda_driver_version
        .as_deref()
        .or(r.cuda_driver.version.as_deref())
        .and_then(parse_major_minor);
    if let (Some(built), Some(have)) = (
        r.build.cuda_version.as_deref().and_then(parse_major_minor),
        driver_cuda,
    ) {
        if have < built {
            let need = min_driver_for_cuda(built.0, built.1).unwrap_or("a newer driver");
            add(
                "driver-too-old",
                gpu_sev,
                format!(
                    "driver {} supports CUDA {}.{}, but this binary was built for CUDA {}.{}",
                    r.nvml.driver_version.as_deref().unwrap_or("?"),
                    have.0,
                    have.1,
                    built.0,
                    built.1
                ),
                "the driver rejects PTX and runtime libraries newer than the CUDA version it supports (CUDA_ERROR_UNSUPPORTED_PTX_VERSION)",
                format!(
                    "upgrade the NVIDIA driver to >= {need}, or rebuild with a CUDA {}.{} toolchain (CUDARC_CUDA_VERSION={}{:01}0)",
                    have.0, have.1, have.0, have.1
                ),
            );
        }
    }
    // candle's kernels are compiled for one compute capability (90 → sm_90a, arch-specific).
    if let Some(cap) = r
        .build
        .compute_cap
        .as_deref()
        .and_then(|c| c.parse::<u32>().ok())
    {
        for g in &r.gpus {
            let Some(cc) = g.compute_capability else {
                continue;
            };
            let v = cc.as_u32();
            let mismatch = if cap == 90 { v != 90 } else { v < cap };
            if mismatch {
                add(
                    "compute-cap-mismatch",
                    gpu_sev,
                    format!(
                        "GPU {} ({}) has compute capability {cc}, but this build's kernels target sm_{cap}{}",
                        g.index,
                        g.name.as_deref().unwrap_or("?"),
                        if cap == 90 { "a" } else { "" }
                    ),
                    "kernels compiled for another architecture fail to load (CUDA_ERROR_NO_BINARY_FOR_GPU / invalid PTX)",
                    format!(
                        "rebuild for this GPU: CUDA_COMPUTE_CAP={v} cargo build --release --features cuda"
                    ),
                );
            }
        }
    }
    // Missing runtime libraries where a CUDA build would need them.
    if r.build.cuda || any_gpu {
        for l in &r.libraries {
            let needed = l.needed_by.starts_with("cuda build")
                || (l.needed_by.starts_with("nccl build") && (r.build.nccl || r.gpus.len() > 1));
            if needed && !l.found {
                add(
                    "missing-library",
                    Severity::Warning,
                    format!("{} ({}) is not loadable", l.name, l.soname),
                    "a CUDA build of wick links it and will not start (or fail at first use) without it",
                    format!(
                        "install it (CUDA 13 toolkit, or the nvidia-* pip wheels) and add its folder to LD_LIBRARY_PATH; {}",
                        l.error.as_deref().unwrap_or("")
                    )
                    .trim_end_matches("; ")
                    .to_string(),
                );
            }
        }
    }

    // --- per GPU ----------------------------------------------------------------------------
    let me = std::process::id();
    let idle: Vec<u32> = r
        .gpus
        .iter()
        .filter(|g| g.processes.iter().all(|p| p.pid == me) && g.utilization_pct.unwrap_or(0) < 10)
        .map(|g| g.index)
        .collect();
    for g in &r.gpus {
        let label = format!("GPU {} ({})", g.index, g.name.as_deref().unwrap_or("?"));
        if g.persistence_mode == Some(false) {
            add(
                "persistence-mode",
                Severity::Warning,
                format!("{label}: persistence mode is off"),
                "without persistence the driver tears the GPU state down when the last client exits, so every run pays a 1-3 s initialisation and clocks/ECC state reset",
                format!("sudo nvidia-smi -i {} -pm 1   (or: sudo systemctl enable --now nvidia-persistenced)", g.index),
            );
        }
        let others: Vec<&GpuProcess> = g.processes.iter().filter(|p| p.pid != me).collect();
        if !others.is_empty() {
            let list = others
                .iter()
                .map(|p| {
                    format!(
                        "pid {} {}{}",
                        p.pid,
                        p.name.as_deref().unwrap_or("?"),
                        p.used_memory_bytes
                            .map(|b| format!(" {}", gib(b)))
                            .unwrap_or_default()
                    )
                })
                .collect::<Vec<_>>()
                .join(", ");
            let alt = idle
                .first()
                .map(|i| format!(", or use an idle GPU: export CUDA_VISIBLE_DEVICES={i}"))
                .unwrap_or_default();
            add(
                "gpu-busy",
                Severity::Warning,
                format!("{label} is used by {} other process(es): {list}", others.len()),
                "other processes take memory and SM time: step times become noisy and large batches may run out of memory",
                format!("stop them (kill <pid>) or wait{alt}"),
            );
        } else if let (Some(t), Some(f)) = (g.memory_total_bytes, g.memory_free_bytes) {
            // Processes of other containers are invisible: fall back to memory in use.
            if t > 0 && f < t / 2 {
                add(
                    "gpu-memory-used",
                    Severity::Warning,
                    format!(
                        "{label}: only {} of {} free, no process listed",
                        gib(f),
                        gib(t)
                    ),
                    "another container or VM is probably using this GPU",
                    "check nvidia-smi on the host; pick another GPU with CUDA_VISIBLE_DEVICES"
                        .into(),
                );
            }
        }
        if let (Some(lim), Some(def)) = (g.power_limit_w, g.default_power_limit_w) {
            if lim + 1.0 < def {
                add(
                    "power-limit",
                    Severity::Warning,
                    format!("{label}: power limit {lim:.0} W, below the default {def:.0} W"),
                    "a lowered power cap holds clocks down under load",
                    format!("sudo nvidia-smi -i {} -pl {def:.0}", g.index),
                );
            }
        }
        let bad: Vec<&String> = g
            .throttle_reasons
            .iter()
            .filter(|t| {
                t.contains("thermal") || t.contains("hw_slowdown") || t.contains("power_brake")
            })
            .collect();
        if !bad.is_empty() {
            add(
                "throttling",
                Severity::Warning,
                format!(
                    "{label}: clocks throttled ({})",
                    bad.iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                "hardware or thermal slowdown lowers throughput by up to half",
                "check cooling and power delivery: nvidia-smi -q -d PERFORMANCE,TEMPERATURE".into(),
            );
        }
        if let (Some(w), Some(mw)) = (g.pcie_width, g.pcie_max_width) {
            if w < mw {
                add(
                    "pcie-width",
                    Severity::Tip,
                    format!("{label}: PCIe link x{w} of x{mw}"),
                    "a narrow link slows host-to-device copies (the data phase of every step)",
                    "check the slot/riser; re-check under load with nvidia-smi -q -d PCIE (links may narrow at idle)".into(),
                );
            }
        }
    }
    if r.gpus.len() > 1 && r.gpus.iter().all(|g| g.nvlink_active.unwrap_or(0) == 0) {
        add(
            "no-nvlink",
            Severity::Tip,
            format!("{} GPUs without an active NVLink", r.gpus.len()),
            "data-parallel all-reduce then runs over PCIe: communication can dominate the step",
            "raise gradient accumulation to all-reduce less often, or use NVLink-connected GPUs"
                .into(),
        );
    }

    // --- precision ----------------------------------------------------------------------------
    let best = r.gpus.iter().filter_map(|g| g.compute_capability).max();
    if let Some(cc) = best {
        let caps = Capabilities::of(cc);
        match r.planned_precision {
            Some(Precision::Bf16Mixed) if !caps.bf16 => add(
                "bf16-unsupported",
                Severity::Warning,
                format!("bf16-mixed planned, but the best GPU has compute capability {cc} (< 8.0)"),
                "without bf16 tensor cores, bf16 matmuls are emulated and slow",
                "use --precision 16-mixed (f16 with dynamic loss scaling)".into(),
            ),
            Some(Precision::Bf16Mixed) => {}
            planned if caps.bf16 => add(
                "use-bf16",
                Severity::Tip,
                format!(
                    "compute capability {cc} has bf16 tensor cores{}",
                    match planned {
                        Some(p) => format!(" but the planned precision is {p}"),
                        None => String::new(),
                    }
                ),
                "bf16-mixed runs matmuls on tensor cores (H200: 4096³ matmul 785 TFLOP/s in bf16 against 51 in f32) and, unlike f16, needs no loss scaling",
                "train with --precision bf16-mixed".into(),
            ),
            _ => {}
        }
        if caps.tf32 && r.planned_precision == Some(Precision::Fp32) {
            add(
                "use-tf32",
                Severity::Tip,
                "fp32 training planned on a GPU with TF32 tensor cores".into(),
                "TF32 GEMMs keep f32 storage and accumulation with a 10-bit mantissa on the inputs (H200: 51 → 390 TFLOP/s)",
                "PerfSettings { tf32: true, .. } (candle: set_gemm_reduced_precision_f32(true))".into(),
            );
        }
    }

    // --- host -----------------------------------------------------------------------------------
    let slow: Vec<String> = r
        .cpu
        .governors
        .iter()
        .filter(|(g, _)| g.as_str() != "performance")
        .map(|(g, n)| format!("{g} on {n} CPU(s)"))
        .collect();
    if !slow.is_empty() {
        add(
            "cpu-governor",
            Severity::Warning,
            format!("CPU frequency governor: {}", slow.join(", ")),
            "a power-saving governor lowers clocks between bursts: data loading and kernel launches (host-bound in candle) slow down and step times jitter",
            "sudo cpupower frequency-set -g performance   (or: echo performance | sudo tee /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor)".into(),
        );
    }
    if let Some(q) = r.cpu.cgroup_cpu_quota {
        let q_int = q.floor().max(1.0) as usize;
        if r.cpu.rayon_threads > q_int {
            add(
                "rayon-threads",
                Severity::Warning,
                format!("rayon uses {} threads but the cgroup allows {q:.1} CPUs", r.cpu.rayon_threads),
                "oversubscribed threads are throttled by the CPU quota: the fused CPU optimizer and data workers stall",
                format!("export RAYON_NUM_THREADS={q_int}"),
            );
        }
    }

    out.sort_by_key(|r| r.severity);
    out
}

/// Whether nothing blocks training on the required device.
pub fn ready(recs: &[Recommendation]) -> bool {
    recs.iter().all(|r| r.severity != Severity::Blocker)
}

/// One line saying what this machine can train on.
pub fn verdict(r: &DoctorReport, recs: &[Recommendation]) -> String {
    let gpus = r.usable_gpus();
    let blockers: Vec<&str> = recs
        .iter()
        .filter(|x| x.severity == Severity::Blocker)
        .map(|x| x.finding.as_str())
        .collect();
    if !blockers.is_empty() {
        return format!(
            "NOT READY for {}: {}",
            match r.require {
                Some(Require::Cuda) => "CUDA training",
                _ => "training",
            },
            blockers.join("; ")
        );
    }
    if r.build.cuda && gpus > 0 {
        format!("ready: CUDA training on {gpus} GPU(s) (and CPU)")
    } else if gpus > 0 || !r.gpus.is_empty() {
        "ready for CPU training; GPUs are present but this build has no `cuda` feature".into()
    } else {
        "ready for CPU training; no NVIDIA GPU on this machine".into()
    }
}

/// Everything `--json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct DoctorOutput<'a> {
    /// The facts.
    pub report: &'a DoctorReport,
    /// What to do, most severe first.
    pub recommendations: &'a [Recommendation],
    /// No blocker.
    pub ready: bool,
    /// One-line summary.
    pub verdict: String,
}

// ---------------------------------------------------------------------------------------------
// Text
// ---------------------------------------------------------------------------------------------

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref()
        .map(|x| x.to_string())
        .unwrap_or_else(|| "?".into())
}

/// The human-readable report: facts, then recommendations, then the verdict.
pub fn render_text(r: &DoctorReport, recs: &[Recommendation]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "wick doctor (wick {}, candle {})",
        r.build.wick_version, r.build.candle_version
    );
    let _ = writeln!(s, "\nsystem");
    let _ = writeln!(
        s,
        "  os        {}, kernel {}, {}{}",
        r.host.os,
        opt(&r.host.kernel),
        r.host.arch,
        r.host
            .hostname
            .as_ref()
            .map(|h| format!(", host {h}"))
            .unwrap_or_default()
    );
    let gov = if r.cpu.governors.is_empty() {
        "n/a (no cpufreq in /sys: VM or container)".to_string()
    } else {
        r.cpu
            .governors
            .iter()
            .map(|(g, n)| format!("{g} x{n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(
        s,
        "  cpu       {}, {} logical / {} physical cores{}, rayon {} threads",
        opt(&r.cpu.model),
        r.cpu.logical_cores,
        opt(&r.cpu.physical_cores),
        r.cpu
            .cgroup_cpu_quota
            .map(|q| format!(" (cgroup quota {q:.1})"))
            .unwrap_or_default(),
        r.cpu.rayon_threads
    );
    let _ = writeln!(
        s,
        "  governor  {gov}{}{}",
        r.cpu
            .scaling_driver
            .as_ref()
            .map(|d| format!(" ({d})"))
            .unwrap_or_default(),
        r.cpu
            .max_mhz
            .map(|m| format!(", max {m:.0} MHz"))
            .unwrap_or_default()
    );
    let _ = writeln!(
        s,
        "  memory    {} total, {} available{}",
        r.memory.total_bytes.map(gib).unwrap_or_else(|| "?".into()),
        r.memory
            .available_bytes
            .map(gib)
            .unwrap_or_else(|| "?".into()),
        r.memory
            .cgroup_limit_bytes
            .map(|b| format!(", cgroup limit {}", gib(b)))
            .unwrap_or_default()
    );
    let on = |b: bool| if b { "on" } else { "off" };
    let _ = writeln!(s, "\nbuild");
    let _ = writeln!(
        s,
        "  {} build, features: cuda {}, nccl {}{}{}",
        r.build.profile,
        on(r.build.cuda),
        on(r.build.nccl),
        r.build
            .cuda_version
            .as_ref()
            .map(|v| format!(", built for CUDA {v}"))
            .unwrap_or_default(),
        r.build
            .compute_cap
            .as_ref()
            .map(|c| format!(", kernels for sm_{c}"))
            .unwrap_or_default()
    );

    let _ = writeln!(s, "\nGPUs");
    if r.nvml.loaded {
        let _ = writeln!(
            s,
            "  driver {}, supports CUDA {}, NVML {}",
            opt(&r.nvml.driver_version),
            opt(&r.nvml.cuda_driver_version),
            opt(&r.nvml.nvml_version)
        );
    }
    if r.gpus.is_empty() {
        let _ = writeln!(
            s,
            "  none found: {}",
            r.nvml.error.as_deref().unwrap_or("NVML lists no GPU")
        );
    }
    for g in &r.gpus {
        let cc = g
            .compute_capability
            .map(|c| c.to_string())
            .unwrap_or_else(|| "?".into());
        let _ = writeln!(
            s,
            "  [{}] {} (cc {cc}){}",
            g.index,
            opt(&g.name),
            g.pci_bus_id
                .as_ref()
                .map(|b| format!(" at {b}"))
                .unwrap_or_default()
        );
        let _ = writeln!(
            s,
            "      memory {} free of {}; persistence {}; util {}%; {} °C",
            g.memory_free_bytes.map(gib).unwrap_or_else(|| "?".into()),
            g.memory_total_bytes.map(gib).unwrap_or_else(|| "?".into()),
            g.persistence_mode.map(on).unwrap_or("?"),
            opt(&g.utilization_pct),
            opt(&g.temperature_c)
        );
        let _ = writeln!(
            s,
            "      clocks SM {}/{} MHz, mem {}/{} MHz; power {} W of {} W limit (default {})",
            opt(&g.sm_clock_mhz),
            opt(&g.max_sm_clock_mhz),
            opt(&g.mem_clock_mhz),
            opt(&g.max_mem_clock_mhz),
            g.power_usage_w
                .map(|w| format!("{w:.0}"))
                .unwrap_or_else(|| "?".into()),
            g.power_limit_w
                .map(|w| format!("{w:.0}"))
                .unwrap_or_else(|| "?".into()),
            g.default_power_limit_w
                .map(|w| format!("{w:.0}"))
                .unwrap_or_else(|| "?".into()),
        );
        let _ = writeln!(
            s,
            "      PCIe gen {}/{} x{}/x{}; NVLink {}; bf16 {}, tf32 {}, fp8 {}",
            opt(&g.pcie_gen),
            opt(&g.pcie_max_gen),
            opt(&g.pcie_width),
            opt(&g.pcie_max_width),
            match (g.nvlink_active, g.nvlink_links) {
                (Some(a), Some(n)) => format!("{a}/{n} links active"),
                _ => "n/a".into(),
            },
            on(g.capabilities.bf16),
            on(g.capabilities.tf32),
            on(g.capabilities.fp8)
        );
        if !g.throttle_reasons.is_empty() {
            let _ = writeln!(s, "      clock limits: {}", g.throttle_reasons.join(", "));
        }
        if g.processes.is_empty() {
            let _ = writeln!(s, "      processes: none");
        }
        for p in &g.processes {
            let _ = writeln!(
                s,
                "      process {} {} ({}){}",
                p.pid,
                opt(&p.name),
                p.kind,
                p.used_memory_bytes
                    .map(|b| format!(" {}", gib(b)))
                    .unwrap_or_default()
            );
        }
        for e in &g.errors {
            let _ = writeln!(s, "      (could not read {e})");
        }
    }
    let d = &r.cuda_driver;
    let _ = writeln!(
        s,
        "  CUDA driver API (libcuda.so.1): {}",
        if d.loaded {
            format!(
                "CUDA {}, cuInit {}, {} device(s) visible",
                opt(&d.version),
                opt(&d.init),
                opt(&d.device_count)
            )
        } else {
            format!("not loadable ({})", d.error.as_deref().unwrap_or("?"))
        }
    );
    for (k, v) in &r.env {
        let _ = writeln!(s, "  {k}={v}");
    }

    let _ = writeln!(s, "\nCUDA libraries");
    for l in &r.libraries {
        let _ = writeln!(
            s,
            "  {:<13} {:<18} {}",
            l.name,
            l.soname,
            if l.found {
                format!(
                    "found{}{}",
                    l.version
                        .as_ref()
                        .map(|v| format!(" {v}"))
                        .unwrap_or_default(),
                    l.path
                        .as_ref()
                        .map(|p| format!("  {p}"))
                        .unwrap_or_default()
                )
            } else {
                format!("not found  [{}]", l.needed_by)
            }
        );
    }

    let _ = writeln!(s, "\nrecommendations");
    if recs.is_empty() {
        let _ = writeln!(s, "  none");
    }
    for x in recs {
        let tag = match x.severity {
            Severity::Blocker => "BLOCKER",
            Severity::Warning => "warning",
            Severity::Tip => "tip",
        };
        let _ = writeln!(s, "  [{tag}] {}", x.finding);
        let _ = writeln!(s, "      why: {}", x.reason);
        let _ = writeln!(s, "      do:  {}", x.action);
    }
    let _ = writeln!(s, "\n{}", verdict(r, recs));
    s
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
