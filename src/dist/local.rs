//! An in-process [`Collective`]: N ranks as threads of one process, meeting at a shared
//! rendezvous (a generation-counting barrier on a `Mutex` + `Condvar`, with a timeout, and one
//! buffer slot per rank).
//!
//! Results are exact and deterministic: sums are taken in rank order `0..N-1` in the tensor's
//! precision (f64 for f64 tensors, f32 for every other float dtype, which round-trips through
//! f32), and every rank computes the same bits. It is the CPU test double of NCCL for the DDP
//! logic: bucketing, averaging, skip agreement, ZeRO sharding (tests/ddp.rs).
//!
//! Every collective is two barrier phases: each rank deposits its payload and waits for all;
//! each computes its result from all slots; all wait again, so no rank overwrites its slot
//! while another is still reading. A rank whose handle is dropped has left: a collective that
//! still needs it fails at once on the other ranks (no hang), as does any collective after a
//! timeout or a mismatch (a different op, dtype or shape on two ranks).
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use wick::dist::{Collective, LocalCollective};
//! let ranks = LocalCollective::group(2).unwrap();
//! let handles: Vec<_> = ranks.into_iter().map(|c| std::thread::spawn(move || {
//!     let t = Tensor::new(&[c.rank() as f32 + 1.0], &Device::Cpu).unwrap();
//!     c.all_reduce_sum(&t).unwrap().to_vec1::<f32>().unwrap()
//! })).collect();
//! for h in handles { assert_eq!(h.join().unwrap(), vec![3.0]); }
//! ```

use super::{check_flat, check_float, Collective, ReduceOp};
use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device, Tensor};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Default time a rank waits for the others at a collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// One rank of an in-process group (see the module docs). `Send`: move it into its thread.
#[derive(Debug)]
pub struct LocalCollective {
    rank: usize,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Debug)]
struct State {
    generation: u64,
    arrived: Vec<bool>,
    left: Vec<bool>,
    broken: Option<String>,
    slots: Vec<Option<Slot>>,
}

#[derive(Debug, Clone, PartialEq)]
enum Data {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Data {
    fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::F64(v) => v.len(),
        }
    }
}

#[derive(Debug, Clone)]
struct Slot {
    /// The collective and its arguments that must agree across ranks, e.g. "all_reduce(Sum)".
    op: String,
    dtype: DType,
    dims: Vec<usize>,
    data: Data,
}

impl LocalCollective {
    /// A group of `world_size` ranks (index `r` is rank `r`) with the default timeout.
    pub fn group(world_size: usize) -> Result<Vec<Self>> {
        Self::group_with_timeout(world_size, DEFAULT_TIMEOUT)
    }

    /// A group of `world_size` ranks whose collectives fail after waiting `timeout` for the
    /// others.
    pub fn group_with_timeout(world_size: usize, timeout: Duration) -> Result<Vec<Self>> {
        if world_size == 0 {
            bail!("a process group needs at least one rank");
        }
        let shared = Arc::new(Shared {
            world: world_size,
            timeout,
            state: Mutex::new(State {
                generation: 0,
                arrived: vec![false; world_size],
                left: vec![false; world_size],
                broken: None,
                slots: vec![None; world_size],
            }),
            cv: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| Self {
                rank,
                shared: shared.clone(),
            })
            .collect())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // a panicking rank thread cannot leave the state half-written in a way that matters:
        // every field is checked again by the waiters
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until every rank has arrived at this generation's barrier.
    fn wait_all<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        what: &str,
    ) -> Result<MutexGuard<'a, State>> {
        if let Some(b) = &st.broken {
            bail!("rank {}: {what}: the group is broken: {b}", self.rank);
        }
        let generation = st.generation;
        st.arrived[self.rank] = true;
        if st.arrived.iter().all(|&a| a) {
            st.arrived.iter_mut().for_each(|a| *a = false);
            st.generation += 1;
            self.shared.cv.notify_all();
            return Ok(st);
        }
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            if st.generation != generation {
                return Ok(st);
            }
            if let Some(b) = &st.broken {
                bail!("rank {}: {what}: the group is broken: {b}", self.rank);
            }
            let missing: Vec<usize> = (0..self.shared.world).filter(|&r| !st.arrived[r]).collect();
            if let Some(&r) = missing.iter().find(|&&r| st.left[r]) {
                let msg = format!("rank {r} left the group before {what}");
                st.broken = Some(msg.clone());
                self.shared.cv.notify_all();
                bail!("rank {}: {msg}", self.rank);
            }
            let now = Instant::now();
            if now >= deadline {
                let msg = format!(
                    "{what}: rank(s) {missing:?} did not arrive within {:.1} s",
                    self.shared.timeout.as_secs_f64()
                );
                st.broken = Some(msg.clone());
                self.shared.cv.notify_all();
                bail!("rank {}: {msg}", self.rank);
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Deposits `slot`, waits for every rank's, runs `f` on all slots (rank order), waits
    /// again (so no slot is overwritten while read), returns `f`'s result.
    fn exchange<R>(&self, slot: Slot, f: impl FnOnce(&[&Slot]) -> Result<R>) -> Result<R> {
        let what = slot.op.clone();
        let mut st = self.lock();
        st.slots[self.rank] = Some(slot);
        let st = self.wait_all(st, &what)?;
        let result = {
            let slots: Option<Vec<&Slot>> = st.slots.iter().map(|s| s.as_ref()).collect();
            match slots {
                Some(slots) => agree(&slots, &what).and_then(|()| f(&slots)),
                None => Err(anyhow!("{what}: a rank's buffer is missing")),
            }
        };
        let st = self.wait_all(st, &format!("the end of {what}"))?;
        drop(st);
        result.map_err(|e| anyhow!("rank {}: {e}", self.rank))
    }

    fn slot(&self, op: String, t: &Tensor) -> Result<Slot> {
        check_float(t.dtype(), &op)?;
        let flat = t.flatten_all()?;
        let data = if t.dtype() == DType::F64 {
            Data::F64(flat.to_vec1::<f64>()?)
        } else {
            Data::F32(flat.to_dtype(DType::F32)?.to_vec1::<f32>()?)
        };
        Ok(Slot {
            op,
            dtype: t.dtype(),
            dims: t.dims().to_vec(),
            data,
        })
    }
}

/// Every rank called the same collective with the same dtype and shape.
fn agree(slots: &[&Slot], what: &str) -> Result<()> {
    let first = slots[0];
    for (r, s) in slots.iter().enumerate().skip(1) {
        if s.op != first.op || s.dtype != first.dtype || s.dims != first.dims {
            bail!(
                "{what}: ranks disagree: rank 0 called {} with {:?} {:?}, rank {r} called {} with {:?} {:?}",
                first.op,
                first.dtype,
                first.dims,
                s.op,
                s.dtype,
                s.dims
            );
        }
    }
    Ok(())
}

/// Reduces the slots' data element-wise in rank order.
fn reduce(slots: &[&Slot], op: ReduceOp) -> Result<Data> {
    fn go<T: Copy + std::ops::Add<Output = T> + PartialOrd>(
        vs: &[&Vec<T>],
        op: ReduceOp,
    ) -> Vec<T> {
        let mut acc = vs[0].clone();
        for v in &vs[1..] {
            for (a, &b) in acc.iter_mut().zip(v.iter()) {
                *a = match op {
                    ReduceOp::Sum => *a + b,
                    // NaN-propagating maximum
                    ReduceOp::Max => {
                        if b > *a || b.partial_cmp(&b).is_none() {
                            b
                        } else {
                            *a
                        }
                    }
                };
            }
        }
        acc
    }
    match &slots[0].data {
        Data::F32(_) => {
            let vs: Option<Vec<&Vec<f32>>> = slots
                .iter()
                .map(|s| match &s.data {
                    Data::F32(v) => Some(v),
                    Data::F64(_) => None,
                })
                .collect();
            let vs = vs.ok_or_else(|| anyhow!("mixed buffer types"))?;
            Ok(Data::F32(go(&vs, op)))
        }
        Data::F64(_) => {
            let vs: Option<Vec<&Vec<f64>>> = slots
                .iter()
                .map(|s| match &s.data {
                    Data::F64(v) => Some(v),
                    Data::F32(_) => None,
                })
                .collect();
            let vs = vs.ok_or_else(|| anyhow!("mixed buffer types"))?;
            Ok(Data::F64(go(&vs, op)))
        }
    }
}

fn to_tensor(data: Data, dims: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    let t = match data {
        Data::F32(v) => Tensor::from_vec(v, dims, device)?,
        Data::F64(v) => Tensor::from_vec(v, dims, device)?,
    };
    Ok(if t.dtype() == dtype {
        t
    } else {
        t.to_dtype(dtype)?
    })
}

fn narrow(data: &Data, start: usize, len: usize) -> Data {
    match data {
        Data::F32(v) => Data::F32(v[start..start + len].to_vec()),
        Data::F64(v) => Data::F64(v[start..start + len].to_vec()),
    }
}

impl Collective for LocalCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn backend(&self) -> &'static str {
        "local"
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let slot = self.slot(format!("all_reduce({op:?})"), t)?;
        let data = self.exchange(slot, |s| reduce(s, op))?;
        to_tensor(data, t.dims(), t.dtype(), t.device())
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.shared.world {
            bail!(
                "broadcast from rank {root} in a group of {}",
                self.shared.world
            );
        }
        let slot = self.slot(format!("broadcast(root {root})"), t)?;
        let data = self.exchange(slot, |s| Ok(s[root].data.clone()))?;
        to_tensor(data, t.dims(), t.dtype(), t.device())
    }

    fn reduce_scatter_sum(&self, flat: &Tensor) -> Result<Tensor> {
        check_flat(flat, "reduce_scatter_sum")?;
        let n = flat.elem_count();
        let w = self.shared.world;
        if n % w != 0 {
            bail!("reduce_scatter_sum: {n} elements do not split into {w} equal shards (pad the input to a multiple of the world size first)");
        }
        let k = n / w;
        let slot = self.slot("reduce_scatter(Sum)".into(), flat)?;
        let rank = self.rank;
        let data = self.exchange(slot, |s| {
            Ok(narrow(&reduce(s, ReduceOp::Sum)?, rank * k, k))
        })?;
        to_tensor(data, &[k], flat.dtype(), flat.device())
    }

    fn all_gather(&self, shard: &Tensor) -> Result<Tensor> {
        check_flat(shard, "all_gather")?;
        let slot = self.slot("all_gather".into(), shard)?;
        let data = self.exchange(slot, |s| {
            Ok(match &s[0].data {
                Data::F32(_) => Data::F32(
                    s.iter()
                        .flat_map(|x| match &x.data {
                            Data::F32(v) => v.clone(),
                            Data::F64(_) => Vec::new(),
                        })
                        .collect(),
                ),
                Data::F64(_) => Data::F64(
                    s.iter()
                        .flat_map(|x| match &x.data {
                            Data::F64(v) => v.clone(),
                            Data::F32(_) => Vec::new(),
                        })
                        .collect(),
                ),
            })
        })?;
        let n = data.len();
        to_tensor(data, &[n], shard.dtype(), shard.device())
    }

    fn barrier(&self) -> Result<()> {
        let slot = Slot {
            op: "barrier".into(),
            dtype: DType::F32,
            dims: vec![0],
            data: Data::F32(Vec::new()),
        };
        self.exchange(slot, |_| Ok(()))
    }
}

impl Drop for LocalCollective {
    fn drop(&mut self) {
        let mut st = self.lock();
        st.left[self.rank] = true;
        self.shared.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<R: Send + 'static>(
        world: usize,
        f: impl Fn(LocalCollective) -> Result<R> + Send + Sync + 'static,
    ) -> Vec<Result<R>> {
        let f = Arc::new(f);
        let hs: Vec<_> = LocalCollective::group(world)
            .unwrap()
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn collectives_are_exact_and_in_rank_order() {
        let out = run(3, |c| {
            let r = c.rank() as f32;
            let dev = Device::Cpu;
            let t = Tensor::new(&[[r, 10.0 * r], [1.0, -r]], &dev)?;
            let sum = c.all_reduce_sum(&t)?.to_vec2::<f32>()?;
            let max = c.all_reduce_max(&t)?.to_vec2::<f32>()?;
            let b = c.broadcast(&t, 2)?.to_vec2::<f32>()?;
            let flat = Tensor::new(&[r, r, r, 1.0, 1.0, 1.0], &dev)?;
            let rs = c.reduce_scatter_sum(&flat)?.to_vec1::<f32>()?;
            let g = c
                .all_gather(&Tensor::new(&[r, r + 0.5], &dev)?)?
                .to_vec1::<f32>()?;
            // bf16 round-trips through f32; f64 stays f64
            let h = c.all_reduce_sum(&Tensor::new(&[0.1f64 * (r as f64 + 1.0)], &dev)?)?;
            c.barrier()?;
            Ok((sum, max, b, rs, g, h.to_vec1::<f64>()?))
        });
        for (rank, o) in out.into_iter().enumerate() {
            let (sum, max, b, rs, g, h) = o.unwrap();
            assert_eq!(sum, vec![vec![3.0, 30.0], vec![3.0, -3.0]]);
            assert_eq!(max, vec![vec![2.0, 20.0], vec![1.0, 0.0]]);
            assert_eq!(b, vec![vec![2.0, 20.0], vec![1.0, -2.0]]);
            assert_eq!(rs, [[3.0, 3.0], [3.0, 3.0], [3.0, 3.0]][rank].to_vec());
            assert_eq!(g, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
            assert_eq!(h, vec![0.1f64 + 0.2 + 0.30000000000000004]);
        }
    }

    #[test]
    fn mismatch_and_departure_fail_without_hanging() {
        let out = run(2, |c| {
            let n = if c.rank() == 0 { 2 } else { 3 };
            c.all_reduce_sum(&Tensor::zeros(n, DType::F32, &Device::Cpu)?)
        });
        for o in out {
            let e = format!("{:#}", o.unwrap_err());
            assert!(e.contains("ranks disagree"), "{e}");
        }
        let out = run(2, |c| {
            if c.rank() == 1 {
                return Ok(()); // leaves without calling the collective
            }
            c.barrier()
        });
        let e = format!("{:#}", out[0].as_ref().unwrap_err());
        assert!(e.contains("rank 1 left the group"), "{e}");

        let mut g = LocalCollective::group_with_timeout(2, Duration::from_millis(50)).unwrap();
        let _r1 = g.pop();
        let e = format!("{:#}", g[0].barrier().unwrap_err());
        assert!(e.contains("[1] did not arrive"), "{e}");
        assert!(LocalCollective::group(0).is_err());
    }
}
