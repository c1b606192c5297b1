//! `wick launch`: starts the local ranks of a data-parallel job and supervises them, like
//! `torchrun --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]`
//! (static rendezvous; <https://pytorch.org/docs/stable/elastic/run.html>).
//!
//! Each local rank `l` of node `R` runs `PROGRAM ARGS` with
//!
//! ```text
//! RANK = R * N + l    WORLD_SIZE = M * N    LOCAL_RANK = l    LOCAL_WORLD_SIZE = N
//! GROUP_RANK = R      MASTER_ADDR = A       MASTER_PORT = P
//! NCCL_NVLS_ENABLE = 0   (unless already set: NVLink multicast stays off)
//! ```
//!
//! and no per-rank `CUDA_VISIBLE_DEVICES`: every rank sees all GPUs and picks
//! `cuda:LOCAL_RANK` (NCCL then sees the NVLink topology between them). Its stdout and stderr
//! lines are prefixed with `[rank G] ` and copied to the launcher's stdout and stderr (whole
//! lines, never interleaved mid-line). Every rank runs in its own process group, so stopping a
//! rank stops what it started too.
//!
//! Supervision: when a rank exits with a non-zero status (or is killed by a signal), the
//! launcher sends SIGTERM to every other rank's process group, SIGKILL after the grace period,
//! reaps them, and returns the failure (rank, pid, status); the exit code of `wick launch` is the
//! failed rank's code (128 + signal for a signal). When every rank exits 0, so does the
//! launcher. An interrupt (the `stop` flag, set by the CLI's Ctrl-C handler) forwards SIGINT to
//! the ranks, then SIGKILL after the grace period; exit code 130.

use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Where prefixed output goes.
pub type Sink = Arc<Mutex<dyn Write + Send>>;

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Ranks on this node (one per GPU).
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Host of global rank 0 (on node 0).
    pub master_addr: String,
    /// Port rank 0's rendezvous listens on.
    pub master_port: u16,
    /// The program every rank runs.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Time between SIGTERM (or SIGINT) and SIGKILL when stopping ranks.
    pub grace: Duration,
    /// Set from outside (a Ctrl-C handler) to stop the job.
    pub stop: Option<Arc<AtomicBool>>,
}

impl LaunchConfig {
    /// `nproc_per_node` ranks of `program args` on one node, rendezvous on 127.0.0.1:29500,
    /// 10 s grace.
    pub fn local(nproc_per_node: usize, program: &str, args: &[&str]) -> Self {
        Self {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            program: program.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            grace: Duration::from_secs(10),
            stop: None,
        }
    }

    /// Errors on inconsistent sizes or an empty program.
    pub fn validate(&self) -> Result<()> {
        if self.nproc_per_node == 0 {
            bail!("--nproc-per-node must be >= 1");
        }
        if self.nnodes == 0 {
            bail!("--nnodes must be >= 1");
        }
        if self.node_rank >= self.nnodes {
            bail!(
                "--node-rank {} must be < --nnodes {}",
                self.node_rank,
                self.nnodes
            );
        }
        if self.program.is_empty() {
            bail!("no program to launch: put it after `--`, e.g. `wick launch --nproc-per-node 2 -- ./train --epochs 3`");
        }
        if self.master_port == 0 {
            bail!("--master-port must be 1..65535");
        }
        Ok(())
    }

    /// The world size, `nnodes * nproc_per_node`.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// The environment of local rank `local_rank` (see the module docs).
    pub fn rank_env(&self, local_rank: usize) -> Vec<(String, String)> {
        let rank = self.node_rank * self.nproc_per_node + local_rank;
        let mut env = vec![
            ("RANK".to_string(), rank.to_string()),
            ("WORLD_SIZE".to_string(), self.world_size().to_string()),
            ("LOCAL_RANK".to_string(), local_rank.to_string()),
            (
                "LOCAL_WORLD_SIZE".to_string(),
                self.nproc_per_node.to_string(),
            ),
            ("GROUP_RANK".to_string(), self.node_rank.to_string()),
            ("MASTER_ADDR".to_string(), self.master_addr.clone()),
            ("MASTER_PORT".to_string(), self.master_port.to_string()),
        ];
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            env.push(("NCCL_NVLS_ENABLE".to_string(), "0".to_string()));
        }
        env
    }
}

/// How a rank ended the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// Global rank.
    pub rank: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// Its process id.
    pub pid: u32,
    /// Exit code, when it exited.
    pub code: Option<i32>,
    /// Signal number, when a signal ended it.
    pub signal: Option<i32>,
}

impl RankFailure {
    fn from_status(rank: usize, local_rank: usize, pid: u32, s: ExitStatus) -> Self {
        #[cfg(unix)]
        let signal = std::os::unix::process::ExitStatusExt::signal(&s);
        #[cfg(not(unix))]
        let signal = None;
        Self {
            rank,
            local_rank,
            pid,
            code: s.code(),
            signal,
        }
    }

    /// "exited with status 3" / "was killed by signal 9".
    pub fn status(&self) -> String {
        match (self.code, self.signal) {
            (Some(c), _) => format!("exited with status {c}"),
            (None, Some(s)) => format!("was killed by signal {s}"),
            _ => "ended with an unknown status".into(),
        }
    }
}

/// The result of a launch.
#[derive(Debug, Clone, PartialEq)]
pub enum LaunchOutcome {
    /// Every rank exited with status 0.
    Success,
    /// A rank failed first; the others were stopped.
    Failed {
        /// The first rank seen failing.
        failure: RankFailure,
        /// Global ranks that were still running and were stopped.
        stopped: Vec<usize>,
        /// Seconds since the launch.
        after_s: f64,
    },
    /// The `stop` flag was set; every rank was stopped.
    Interrupted,
}

impl LaunchOutcome {
    /// The launcher's exit code: 0, the failed rank's code (128 + signal), or 130.
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchOutcome::Success => 0,
            LaunchOutcome::Failed { failure, .. } => match (failure.code, failure.signal) {
                (Some(c), _) if c != 0 => c,
                (None, Some(s)) => 128 + s,
                _ => 1,
            },
            LaunchOutcome::Interrupted => 130,
        }
    }

    /// A one-line summary naming the failed rank and its status.
    pub fn message(&self) -> String {
        match self {
            LaunchOutcome::Success => "wick launch: every rank exited with status 0".into(),
            LaunchOutcome::Failed {
                failure,
                stopped,
                after_s,
            } => format!(
                "wick launch: rank {} (local rank {}, pid {}) {} after {:.1} s; stopped the other ranks {:?}",
                failure.rank,
                failure.local_rank,
                failure.pid,
                failure.status(),
                after_s,
                stopped
            ),
            LaunchOutcome::Interrupted => "wick launch: interrupted; stopped every rank".into(),
        }
    }
}

struct Rank {
    rank: usize,
    local_rank: usize,
    child: Child,
    exited: Option<ExitStatus>,
}

/// Launches with output to this process's stdout / stderr.
pub fn launch(config: &LaunchConfig) -> Result<LaunchOutcome> {
    let out: Sink = Arc::new(Mutex::new(std::io::stdout()));
    let err: Sink = Arc::new(Mutex::new(std::io::stderr()));
    launch_with(config, out, err)
}

/// Launches with the ranks' prefixed stdout lines written to `out` and stderr lines to `err`.
/// Returns when every rank has ended (see the module docs). Errors when a rank cannot be
/// started (the ones already started are stopped first).
pub fn launch_with(config: &LaunchConfig, out: Sink, err: Sink) -> Result<LaunchOutcome> {
    config.validate()?;
    let start = Instant::now();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let mut readers = 0usize;
    let mut ranks: Vec<Rank> = Vec::with_capacity(config.nproc_per_node);
    for local_rank in 0..config.nproc_per_node {
        let rank = config.node_rank * config.nproc_per_node + local_rank;
        let mut cmd = Command::new(&config.program);
        cmd.args(&config.args)
            .envs(config.rank_env(local_rank))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut ranks, config.grace, Signal::Term);
                return Err(e).with_context(|| {
                    format!("cannot start rank {rank}: program {:?}", config.program)
                });
            }
        };
        let prefix = format!("[rank {rank}] ");
        if let Some(s) = child.stdout.take() {
            spawn_reader(s, prefix.clone(), out.clone(), done_tx.clone());
            readers += 1;
        }
        if let Some(s) = child.stderr.take() {
            spawn_reader(s, prefix, err.clone(), done_tx.clone());
            readers += 1;
        }
        ranks.push(Rank {
            rank,
            local_rank,
            child,
            exited: None,
        });
    }
    drop(done_tx);

    let outcome = loop {
        let mut failure = None;
        for r in ranks.iter_mut().filter(|r| r.exited.is_none()) {
            if let Ok(Some(s)) = r.child.try_wait() {
                r.exited = Some(s);
                if !s.success() && failure.is_none() {
                    failure = Some(RankFailure::from_status(
                        r.rank,
                        r.local_rank,
                        r.child.id(),
                        s,
                    ));
                }
            }
        }
        if let Some(failure) = failure {
            let stopped: Vec<usize> = ranks
                .iter()
                .filter(|r| r.exited.is_none())
                .map(|r| r.rank)
                .collect();
            let after_s = start.elapsed().as_secs_f64();
            stop_all(&mut ranks, config.grace, Signal::Term);
            break LaunchOutcome::Failed {
                failure,
                stopped,
                after_s,
            };
        }
        if ranks.iter().all(|r| r.exited.is_some()) {
            break LaunchOutcome::Success;
        }
        if config
            .stop
            .as_ref()
            .is_some_and(|s| s.load(Ordering::SeqCst))
        {
            stop_all(&mut ranks, config.grace, Signal::Int);
            break LaunchOutcome::Interrupted;
        }
        std::thread::sleep(Duration::from_millis(20));
    };

    // the readers end when the pipes close; a grandchild that escaped its process group
    // could hold a pipe open, so wait a bounded time only
    let deadline = Instant::now() + Duration::from_secs(2);
    for _ in 0..readers {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    Ok(outcome)
}

fn spawn_reader(
    src: impl Read + Send + 'static,
    prefix: String,
    sink: Sink,
    done: mpsc::Sender<()>,
) {
    std::thread::spawn(move || {
        let mut r = BufReader::new(src);
        let mut line = Vec::with_capacity(256);
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if line.last() != Some(&b'\n') {
                        line.push(b'\n');
                    }
                    let mut w = sink.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = w.write_all(prefix.as_bytes());
                    let _ = w.write_all(&line);
                    let _ = w.flush();
                }
            }
        }
        let _ = done.send(());
    });
}

#[derive(Debug, Clone, Copy)]
enum Signal {
    Term,
    Int,
}

/// Signals every live rank's process group, waits up to `grace`, then SIGKILLs what is left
/// and reaps everything.
fn stop_all(ranks: &mut [Rank], grace: Duration, first: Signal) {
    for r in ranks.iter_mut().filter(|r| r.exited.is_none()) {
        signal_group(&mut r.child, first);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        let mut alive = false;
        for r in ranks.iter_mut().filter(|r| r.exited.is_none()) {
            match r.child.try_wait() {
                Ok(Some(s)) => r.exited = Some(s),
                _ => alive = true,
            }
        }
        if !alive {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // only ranks not yet reaped: their pid (= process group id) cannot have been reused
    for r in ranks.iter_mut().filter(|r| r.exited.is_none()) {
        kill_group(&mut r.child);
        r.exited = r.child.wait().ok();
    }
}

#[cfg(unix)]
fn signal_group(child: &mut Child, s: Signal) {
    let sig = match s {
        Signal::Term => libc::SIGTERM,
        Signal::Int => libc::SIGINT,
    };
    // SAFETY: kill(2) on the child's own process group (created by process_group(0), pgid = pid)
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), sig);
    }
}

#[cfg(not(unix))]
fn signal_group(child: &mut Child, _s: Signal) {
    let _ = child.kill();
}

#[cfg(unix)]
fn kill_group(child: &mut Child) {
    // SAFETY: as in signal_group; ESRCH (group already gone) is ignored
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL);
    }
}

#[cfg(not(unix))]
fn kill_group(child: &mut Child) {
    let _ = child.kill();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capture() -> (Sink, Arc<Mutex<Vec<u8>>>) {
        let buf = Arc::new(Mutex::new(Vec::new()));
        struct W(Arc<Mutex<Vec<u8>>>);
        impl Write for W {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        (Arc::new(Mutex::new(W(buf.clone()))), buf)
    }

    fn text(b: &Arc<Mutex<Vec<u8>>>) -> String {
        String::from_utf8_lossy(&b.lock().unwrap()).into_owned()
    }

    #[test]
    fn ranks_get_the_env_contract_and_prefixed_output() -> Result<()> {
        let mut c = LaunchConfig::local(
            3,
            "sh",
            &["-c", "echo \"r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK lw=$LOCAL_WORLD_SIZE m=$MASTER_ADDR:$MASTER_PORT\"; printf 'no newline' >&2"],
        );
        c.nnodes = 2;
        c.node_rank = 1;
        c.master_port = 29611;
        let ((o, ob), (e, eb)) = (capture(), capture());
        assert_eq!(launch_with(&c, o, e)?, LaunchOutcome::Success);
        let out = text(&ob);
        for l in 0..3 {
            let r = 3 + l;
            let want = format!("[rank {r}] r={r} w=6 l={l} lw=3 m=127.0.0.1:29611\n");
            assert!(out.contains(&want), "{out}");
        }
        assert_eq!(text(&eb).matches("no newline\n").count(), 3);
        Ok(())
    }

    #[test]
    fn a_failing_rank_stops_the_others_quickly() -> Result<()> {
        // rank 1 fails; rank 2 ignores SIGTERM (SIGKILL after the grace period)
        let mut c = LaunchConfig::local(
            3,
            "sh",
            &["-c", "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 3; fi; if [ \"$RANK\" = 2 ]; then trap '' TERM; fi; sleep 30"],
        );
        c.grace = Duration::from_millis(300);
        let t = Instant::now();
        let ((o, _), (e, _)) = (capture(), capture());
        let got = launch_with(&c, o, e)?;
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        match &got {
            LaunchOutcome::Failed {
                failure, stopped, ..
            } => {
                assert_eq!((failure.rank, failure.code), (1, Some(3)));
                assert_eq!(stopped, &vec![0, 2]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(got.exit_code(), 3);
        assert!(
            got.message().contains("rank 1 (local rank 1, pid"),
            "{}",
            got.message()
        );
        assert!(got.message().contains("exited with status 3"));
        Ok(())
    }

    #[test]
    fn stop_flag_and_bad_program() -> Result<()> {
        let mut c = LaunchConfig::local(2, "sh", &["-c", "sleep 30"]);
        let stop = Arc::new(AtomicBool::new(false));
        c.stop = Some(stop.clone());
        c.grace = Duration::from_millis(500);
        let s2 = stop.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            s2.store(true, Ordering::SeqCst);
        });
        let ((o, _), (e, _)) = (capture(), capture());
        let got = launch_with(&c, o, e)?;
        assert_eq!(got, LaunchOutcome::Interrupted);
        assert_eq!(got.exit_code(), 130);

        let c = LaunchConfig::local(2, "/nonexistent/wick-test-program", &[]);
        let ((o, _), (e, _)) = (capture(), capture());
        let err = format!("{:#}", launch_with(&c, o, e).unwrap_err());
        assert!(err.contains("cannot start rank 0"), "{err}");
        let mut c = LaunchConfig::local(2, "sh", &[]);
        c.node_rank = 1;
        assert!(c.validate().is_err());
        Ok(())
    }
}
