//! torchrun's environment contract and a TCP rendezvous that shares a 128-byte blob (NCCL's
//! unique id) from rank 0 to every other rank.
//!
//! Environment (what `torchrun` and `wick launch` set for each process; see
//! <https://pytorch.org/docs/stable/elastic/run.html#environment-variables>):
//!
//! | variable          | meaning                                                        |
//! |-------------------|----------------------------------------------------------------|
//! | `RANK`            | global rank, `0..WORLD_SIZE`                                   |
//! | `WORLD_SIZE`      | number of processes in the job                                 |
//! | `LOCAL_RANK`      | rank on this node; selects the GPU (`cuda:LOCAL_RANK`)         |
//! | `LOCAL_WORLD_SIZE`| processes on this node (optional)                              |
//! | `MASTER_ADDR`     | host of rank 0 (required when `WORLD_SIZE > 1`)                |
//! | `MASTER_PORT`     | TCP port rank 0 listens on (required when `WORLD_SIZE > 1`)    |
//!
//! Rendezvous protocol ([`share_id`]): rank 0 listens on `0.0.0.0:MASTER_PORT`; every other
//! rank connects to `MASTER_ADDR:MASTER_PORT` (retrying until rank 0 listens) and sends
//! `"WICKRDV1" ++ rank (u32 LE) ++ world_size (u32 LE)`. When all `WORLD_SIZE - 1` ranks have
//! arrived, rank 0 answers each with `'K' ++ blob[128]`, so a rank that gets the id knows every
//! rank is alive (NCCL's setup, which waits forever for a missing peer, starts only then).
//! When the timeout passes first, rank 0 answers the ranks that did arrive with
//! `'E' ++ len (u32 LE) ++ message` and returns an error naming the ranks that did not; a
//! rank that cannot reach rank 0, or hears nothing in time, errors too. Each run needs a fresh
//! rendezvous (a new NCCL id); the listener lives only for the duration of [`share_id`].

use anyhow::{anyhow, bail, Context, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Size of the shared blob (NCCL's `ncclUniqueId`).
pub const ID_BYTES: usize = 128;

/// Default rendezvous timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

const MAGIC: &[u8; 8] = b"WICKRDV1";

/// This process's place in the job, from torchrun's environment variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank on this node: the CUDA device ordinal to use.
    pub local_rank: usize,
    /// Processes on this node, when `LOCAL_WORLD_SIZE` is set.
    pub local_world_size: Option<usize>,
    /// Host of rank 0 (`127.0.0.1` when `WORLD_SIZE = 1` and unset).
    pub master_addr: String,
    /// Port rank 0 listens on (29500, torchrun's default, when `WORLD_SIZE = 1` and unset).
    pub master_port: u16,
}

impl DistEnv {
    /// Reads the process environment. `Ok(None)` when none of RANK, WORLD_SIZE and LOCAL_RANK
    /// is set (a plain single-process run); an error naming the variable when the contract is
    /// incomplete or inconsistent.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`Self::from_env`], with the variables looked up through `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let get = |k: &str| {
            var(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let (rank, world, local) = (get("RANK"), get("WORLD_SIZE"), get("LOCAL_RANK"));
        if rank.is_none() && world.is_none() && local.is_none() {
            return Ok(None);
        }
        let missing: Vec<&str> = [
            ("RANK", &rank),
            ("WORLD_SIZE", &world),
            ("LOCAL_RANK", &local),
        ]
        .iter()
        .filter(|(_, v)| v.is_none())
        .map(|(k, _)| *k)
        .collect();
        if !missing.is_empty() {
            bail!(
                "incomplete distributed environment: {} not set (torchrun / `wick launch` set \
                 RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)",
                missing.join(", ")
            );
        }
        let num = |k: &str, v: &Option<String>| -> Result<usize> {
            let v = v.as_deref().unwrap_or_default();
            v.parse::<usize>()
                .map_err(|_| anyhow!("{k}={v:?} is not a non-negative integer"))
        };
        let rank_n = num("RANK", &rank)?;
        let world_n = num("WORLD_SIZE", &world)?;
        let local_n = num("LOCAL_RANK", &local)?;
        if world_n == 0 {
            bail!("WORLD_SIZE must be >= 1, got 0");
        }
        if rank_n >= world_n {
            bail!("RANK={rank_n} must be < WORLD_SIZE={world_n}");
        }
        let local_world = match get("LOCAL_WORLD_SIZE") {
            Some(v) => {
                let n = num("LOCAL_WORLD_SIZE", &Some(v))?;
                if n == 0 || local_n >= n || n > world_n {
                    bail!(
                        "LOCAL_WORLD_SIZE={n} is inconsistent with LOCAL_RANK={local_n} and \
                         WORLD_SIZE={world_n}"
                    );
                }
                Some(n)
            }
            None => None,
        };
        if local_n >= world_n {
            bail!("LOCAL_RANK={local_n} must be < WORLD_SIZE={world_n}");
        }
        let (addr, port) = (get("MASTER_ADDR"), get("MASTER_PORT"));
        if world_n > 1 {
            let missing: Vec<&str> = [("MASTER_ADDR", &addr), ("MASTER_PORT", &port)]
                .iter()
                .filter(|(_, v)| v.is_none())
                .map(|(k, _)| *k)
                .collect();
            if !missing.is_empty() {
                bail!(
                    "WORLD_SIZE={world_n} needs {} (the host and port of rank 0's rendezvous)",
                    missing.join(" and ")
                );
            }
        }
        let master_port = match port {
            Some(p) => match p.parse::<u16>() {
                Ok(n) if n > 0 => n,
                _ => bail!("MASTER_PORT={p:?} is not a TCP port number (1..65535)"),
            },
            None => 29500,
        };
        Ok(Some(Self {
            rank: rank_n,
            world_size: world_n,
            local_rank: local_n,
            local_world_size: local_world,
            master_addr: addr.unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
        }))
    }
}

/// Shares rank 0's `id` with every rank over TCP (see the module docs for the protocol).
/// Rank 0 passes `Some(id)`, the others `None`; every rank returns the id. Errors (naming the
/// ranks that did not arrive, or why rank 0 could not be reached) after `timeout`.
pub fn share_id(
    env: &DistEnv,
    id: Option<&[u8; ID_BYTES]>,
    timeout: Duration,
) -> Result<[u8; ID_BYTES]> {
    if env.world_size == 1 {
        return id
            .copied()
            .ok_or_else(|| anyhow!("rank 0 must provide the id"));
    }
    if env.rank == 0 {
        let id = id.ok_or_else(|| anyhow!("rank 0 must provide the id"))?;
        serve(env, id, timeout)?;
        Ok(*id)
    } else {
        if id.is_some() {
            bail!("only rank 0 provides the id (rank {} got one)", env.rank);
        }
        fetch(env, timeout)
    }
}

fn serve(env: &DistEnv, id: &[u8; ID_BYTES], timeout: Duration) -> Result<()> {
    let world = env.world_size;
    let port = env.master_port;
    let listener = TcpListener::bind(("0.0.0.0", port)).with_context(|| {
        format!("rank 0: cannot listen on port {port} (MASTER_PORT) for the rendezvous; is another job using it? pick another port")
    })?;
    listener
        .set_nonblocking(true)
        .context("rank 0: rendezvous listener")?;
    let deadline = Instant::now() + timeout;
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut problem: Option<String> = None;
    while problem.is_none() && peers.iter().skip(1).any(|p| p.is_none()) {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        match listener.accept() {
            Ok((mut s, from)) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_nodelay(true);
                let wait = (deadline - now).min(Duration::from_secs(10));
                let _ = s.set_read_timeout(Some(wait.max(Duration::from_millis(10))));
                let mut hello = [0u8; 16];
                if s.read_exact(&mut hello).is_err() || &hello[..8] != MAGIC {
                    // not one of ours (a port scan, a stale client): ignore it
                    tracing::warn!(
                        "rendezvous: ignored a connection from {from} without a valid hello"
                    );
                    continue;
                }
                let r = u32::from_le_bytes([hello[8], hello[9], hello[10], hello[11]]) as usize;
                let w = u32::from_le_bytes([hello[12], hello[13], hello[14], hello[15]]) as usize;
                if w != world {
                    problem = Some(format!(
                        "rank {r} (from {from}) has WORLD_SIZE={w}, rank 0 has WORLD_SIZE={world}"
                    ));
                    let _ = send_error(&mut s, problem.as_deref().unwrap_or_default());
                } else if r == 0 || r >= world {
                    problem = Some(format!(
                        "a peer at {from} claims rank {r} (expected 1..{world})"
                    ));
                    let _ = send_error(&mut s, problem.as_deref().unwrap_or_default());
                } else if peers[r].is_some() {
                    problem = Some(format!("rank {r} arrived twice (the second from {from}); two processes have RANK={r}"));
                    let _ = send_error(&mut s, problem.as_deref().unwrap_or_default());
                } else {
                    peers[r] = Some(s);
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e).context("rank 0: rendezvous accept"),
        }
    }
    let missing: Vec<usize> = (1..world).filter(|&r| peers[r].is_none()).collect();
    if problem.is_none() && !missing.is_empty() {
        let arrived: Vec<usize> = (1..world).filter(|&r| peers[r].is_some()).collect();
        problem = Some(format!(
            "rank(s) {missing:?} did not arrive at the rendezvous on port {port} within {:.0} s \
             (arrived: rank 0 and {arrived:?}); check that every rank runs with the same \
             MASTER_ADDR/MASTER_PORT and WORLD_SIZE, and the output of the missing ranks",
            timeout.as_secs_f64()
        ));
    }
    if let Some(p) = problem {
        for s in peers.iter_mut().flatten() {
            let _ = send_error(s, &p);
        }
        bail!("rank 0: {p}");
    }
    let mut msg = Vec::with_capacity(1 + ID_BYTES);
    msg.push(b'K');
    msg.extend_from_slice(id);
    for (r, s) in peers.iter_mut().enumerate() {
        if let Some(s) = s {
            s.write_all(&msg)
                .and_then(|()| s.flush())
                .with_context(|| format!("rank 0: sending the id to rank {r}"))?;
        }
    }
    Ok(())
}

fn send_error(s: &mut TcpStream, msg: &str) -> std::io::Result<()> {
    let mut m = vec![b'E'];
    m.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    m.extend_from_slice(msg.as_bytes());
    s.write_all(&m)?;
    s.flush()
}

/// Resolved addresses of `host:port`, IPv4 first (rank 0 listens on `0.0.0.0`).
fn resolve(host: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
    let mut v: Vec<SocketAddr> = (host, port).to_socket_addrs()?.collect();
    v.sort_by_key(|a| !a.is_ipv4());
    Ok(v)
}

fn fetch(env: &DistEnv, timeout: Duration) -> Result<[u8; ID_BYTES]> {
    let rank = env.rank;
    let target = format!("{}:{}", env.master_addr, env.master_port);
    let deadline = Instant::now() + timeout;
    let mut last_err = String::from("no attempt");
    let mut stream = None;
    'connect: while Instant::now() < deadline {
        match resolve(&env.master_addr, env.master_port) {
            Ok(addrs) if addrs.is_empty() => {
                last_err = format!("{} resolves to no address", env.master_addr)
            }
            Ok(addrs) => {
                for a in addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break 'connect;
                    }
                    match TcpStream::connect_timeout(&a, left.min(Duration::from_secs(2))) {
                        Ok(s) => {
                            stream = Some(s);
                            break 'connect;
                        }
                        Err(e) => last_err = format!("{a}: {e}"),
                    }
                }
            }
            Err(e) => last_err = format!("cannot resolve {}: {e}", env.master_addr),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let Some(mut s) = stream else {
        bail!(
            "rank {rank}: could not reach rank 0's rendezvous at {target} within {:.0} s (last error: \
             {last_err}); is rank 0 running, with the same MASTER_ADDR/MASTER_PORT?",
            timeout.as_secs_f64()
        );
    };
    let _ = s.set_nodelay(true);
    let mut hello = Vec::with_capacity(16);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(env.world_size as u32).to_le_bytes());
    s.write_all(&hello)
        .with_context(|| format!("rank {rank}: sending the hello to {target}"))?;
    // rank 0 is the one that knows who is missing: give it a grace period beyond this rank's
    // own deadline to answer (its clock may have started later)
    let grace = timeout.min(Duration::from_secs(10));
    let left = deadline.saturating_duration_since(Instant::now()) + grace;
    s.set_read_timeout(Some(left.max(Duration::from_millis(10))))?;
    let waited = |e: std::io::Error| -> anyhow::Error {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => anyhow!(
                "rank {rank}: connected to rank 0 at {target} but got no id within {:.0} s \
                 (rank 0 is still waiting for other ranks?)",
                (timeout + grace).as_secs_f64()
            ),
            ErrorKind::UnexpectedEof => {
                anyhow!("rank {rank}: rank 0 at {target} closed the rendezvous connection")
            }
            _ => anyhow!("rank {rank}: rendezvous with {target}: {e}"),
        }
    };
    let mut tag = [0u8; 1];
    s.read_exact(&mut tag).map_err(waited)?;
    match tag[0] {
        b'K' => {
            let mut id = [0u8; ID_BYTES];
            s.read_exact(&mut id).map_err(waited)?;
            Ok(id)
        }
        b'E' => {
            let mut len = [0u8; 4];
            s.read_exact(&mut len).map_err(waited)?;
            let n = (u32::from_le_bytes(len) as usize).min(1 << 16);
            let mut m = vec![0u8; n];
            s.read_exact(&mut m).map_err(waited)?;
            bail!(
                "rank {rank}: rank 0 aborted the rendezvous: {}",
                String::from_utf8_lossy(&m)
            )
        }
        t => bail!("rank {rank}: unexpected rendezvous reply {t:#x} from {target}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(kv: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = kv
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn err(kv: &[(&str, &str)]) -> String {
        format!("{:#}", DistEnv::from_vars(vars(kv)).unwrap_err())
    }

    #[test]
    fn env_contract_is_parsed_with_clear_errors() {
        assert_eq!(DistEnv::from_vars(vars(&[])).unwrap(), None);
        let full = [
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29512"),
        ];
        let e = DistEnv::from_vars(vars(&full)).unwrap().unwrap();
        assert_eq!(
            e,
            DistEnv {
                rank: 3,
                world_size: 4,
                local_rank: 1,
                local_world_size: Some(2),
                master_addr: "node0".into(),
                master_port: 29512
            }
        );
        let solo = DistEnv::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (solo.master_addr.as_str(), solo.master_port),
            ("127.0.0.1", 29500)
        );

        assert!(err(&[("RANK", "0")]).contains("WORLD_SIZE, LOCAL_RANK not set"));
        assert!(
            err(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")])
                .contains("RANK=2 must be < WORLD_SIZE=2")
        );
        assert!(
            err(&[("RANK", "x"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]).contains("RANK=\"x\"")
        );
        assert!(
            err(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")])
                .contains("MASTER_ADDR and MASTER_PORT")
        );
        let bad_port = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "70000"),
        ];
        assert!(err(&bad_port).contains("MASTER_PORT=\"70000\""));
        assert!(
            err(&[("RANK", "0"), ("WORLD_SIZE", "0"), ("LOCAL_RANK", "0")])
                .contains("WORLD_SIZE must be >= 1")
        );
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn env(rank: usize, world: usize, port: u16) -> DistEnv {
        DistEnv {
            rank,
            world_size: world,
            local_rank: rank,
            local_world_size: None,
            master_addr: "localhost".into(),
            master_port: port,
        }
    }

    fn spawn_ranks(
        ranks: &[usize],
        world: usize,
        port: u16,
        timeout: Duration,
    ) -> Vec<(usize, Result<[u8; ID_BYTES]>)> {
        let id: [u8; ID_BYTES] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        let hs: Vec<_> = ranks
            .iter()
            .map(|&r| {
                let e = env(r, world, port);
                std::thread::spawn(move || {
                    // clients first, rank 0 late: the clients must retry
                    if r == 0 {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    (r, share_id(&e, (r == 0).then_some(&id), timeout))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        let port = free_port();
        let id: [u8; ID_BYTES] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        for (r, got) in spawn_ranks(&[0, 1, 2, 3], 4, port, Duration::from_secs(20)) {
            assert_eq!(got.unwrap_or_else(|e| panic!("rank {r}: {e:#}")), id);
        }
    }

    #[test]
    fn a_missing_rank_is_named_on_every_rank() {
        let port = free_port();
        let out = spawn_ranks(&[0, 1], 3, port, Duration::from_millis(1500));
        for (r, got) in out {
            let e = format!("{:#}", got.unwrap_err());
            assert!(e.contains("rank(s) [2] did not arrive"), "rank {r}: {e}");
            if r == 1 {
                assert!(e.contains("rank 0 aborted the rendezvous"), "{e}");
            }
        }
    }

    #[test]
    fn unreachable_rank_zero_and_world_mismatch_are_errors() {
        let port = free_port();
        let e = format!(
            "{:#}",
            share_id(&env(1, 2, port), None, Duration::from_millis(300)).unwrap_err()
        );
        assert!(
            e.contains("could not reach rank 0's rendezvous at localhost:"),
            "{e}"
        );

        let port = free_port();
        let id = [1u8; ID_BYTES];
        let server = std::thread::spawn(move || {
            share_id(&env(0, 2, port), Some(&id), Duration::from_secs(10))
        });
        let client = share_id(&env(1, 3, port), None, Duration::from_secs(10));
        let e = format!("{:#}", client.unwrap_err());
        assert!(
            e.contains("WORLD_SIZE=3") && e.contains("WORLD_SIZE=2"),
            "{e}"
        );
        let e = format!("{:#}", server.join().unwrap().unwrap_err());
        assert!(e.contains("WORLD_SIZE=3"), "{e}");
    }
}
