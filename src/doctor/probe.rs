//! Collecting the facts of a [`super::DoctorReport`]: host, CPU, memory, build, NVML, the CUDA
//! driver and libraries (loaded at run time).

use super::*;

pub(super) fn read_trim(p: impl AsRef<Path>) -> Option<String> {
    fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

pub(super) fn collect_host() -> HostInfo {
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

pub(super) fn collect_cpu() -> CpuInfo {
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

pub(super) fn collect_memory() -> MemoryInfo {
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

pub(super) fn build_info() -> BuildInfo {
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

pub(super) fn collect_env() -> BTreeMap<String, String> {
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
pub(super) fn cuda_version_string(v: i64) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// "13.0" → (13, 0).
pub(super) fn parse_major_minor(s: &str) -> Option<(u32, u32)> {
    let mut it = s.split('.');
    Some((
        it.next()?.trim().parse().ok()?,
        it.next().unwrap_or("0").trim().parse().ok()?,
    ))
}

/// Without the `nvml` feature: no NVML, and the report says so (the CUDA driver and library
/// probes below still run).
#[cfg(not(feature = "nvml"))]
pub(super) fn collect_nvml() -> (NvmlInfo, Vec<GpuInfo>) {
    let info = NvmlInfo {
        loaded: false,
        error: Some("wick was built without the `nvml` feature (no GPU details)".to_string()),
        ..Default::default()
    };
    (info, Vec::new())
}

#[cfg(feature = "nvml")]
pub(super) fn collect_nvml() -> (NvmlInfo, Vec<GpuInfo>) {
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
#[cfg(feature = "nvml")]
pub(super) fn keep<T>(
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
pub(super) fn load(soname: &str) -> Result<&'static libloading::Library, String> {
    // SAFETY: loading runs the library's initialisers; these are NVIDIA's own libraries,
    // which are designed to be dlopen'ed (CUDA applications and PyTorch do so).
    match unsafe { libloading::Library::new(soname) } {
        Ok(lib) => Ok(Box::leak(Box::new(lib))),
        Err(e) => Err(first_line(&e.to_string())),
    }
}

pub(super) fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

/// The file a loaded library was mapped from, found in /proc/self/maps.
pub(super) fn mapped_path(soname: &str) -> Option<String> {
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
pub(super) fn call_int_out(lib: &libloading::Library, sym: &[u8]) -> Option<i64> {
    // SAFETY: the symbol has this C signature in every version of the library it is asked of
    // (cuDriverGetVersion, cudaRuntimeGetVersion, curandGetVersion, ncclGetVersion); none
    // needs an initialised context.
    unsafe {
        let f = lib.get::<IntOut>(sym).ok()?;
        let mut v: std::os::raw::c_int = 0;
        (f(&mut v) == 0).then_some(v as i64)
    }
}

pub(super) fn library_version(name: &str, lib: &libloading::Library) -> Option<String> {
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
pub(super) const LIBRARIES: &[(&str, &str, &str)] = &[
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

pub(super) fn probe_libraries() -> Vec<LibraryInfo> {
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
pub(super) fn cu_error_name(lib: &libloading::Library, code: i32) -> String {
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

pub(super) fn probe_cuda_driver() -> CudaDriverInfo {
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
