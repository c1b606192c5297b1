//! Leaf gradients written once.
//!
//! candle 0.11's backward adds every gradient an op returns into a tensor that it first fills
//! with zeros (`GradStore::or_insert`, then `add`), so a leaf differentiated by one op as a
//! whole, such as an embedding table, costs three table-sized tensors at once: the op's
//! gradient, the zeros and their sum. That happens at the very end of the backward (the
//! lookup is the first op of the forward), while every activation of the graph is still held,
//! so it lands on the step's peak memory: 2 x 47 MB more for BERT's 30522 x 384 f32 word table.
//!
//! The same zeros + add run for every parameter of every layer: two kernel launches and two
//! allocations per parameter per step, host time that a small model's step is made of.
//!
//! [`backward`] runs candle's backward with a sink open on the calling thread. wick's ops
//! ([`crate::ops`]: embedding, linear, bias, the norms, `act_linear`, LoRA, the fused head;
//! and [`crate::recompute`]'s segments) hand the gradient of a leaf (a [`candle_core::Var`]'s
//! tensor: a parameter) to the sink instead of returning it to candle; after the backward the
//! sink's gradients are moved into the `GradStore`, added to whatever candle computed for the
//! same leaf (a table tied to an output layer). The gradients are the same; only the zeros and
//! the extra sum are gone. Without an open sink (candle's own `backward`) the ops return their
//! gradients to candle as usual.
//!
//! wick's block ops ([`crate::ops::pre_norm_stack`]) go further: a whole transformer block is
//! one node whose backward hands gradients from op to op itself, which only works when its
//! parameters' gradients can go to a sink. A forward run under [`forward_for_sink`] promises
//! that; [`crate::Engine::step`] runs its forward closure that way.
//!
//! The sink belongs to the thread, not to one backward: code that runs a backward of its own
//! while another is in progress (inside a custom op's `bwd`, as [`crate::recompute`] does) must
//! call [`backward`] for it, which opens a sink of its own, and not candle's `backward`, whose
//! wick-op leaf gradients would land in the outer sink instead of its own `GradStore`.

use candle_core::backprop::GradStore;
use candle_core::{bail, Result, Tensor, TensorId};
use std::cell::RefCell;
use std::collections::HashMap;

/// A function told of every gradient a sink takes: `(leaf, the leaf's gradient so far)`.
pub type GradHook<'a> = dyn FnMut(&Tensor, &Tensor) -> Result<()> + 'a;

/// An open sink: leaf id → (leaf, gradient so far), and the hook of [`backward_with`].
#[derive(Default)]
struct Sunk {
    grads: HashMap<TensorId, (Tensor, Tensor)>,
    /// Points to the `&mut GradHook` borrowed by the [`backward_with`] call that opened this
    /// sink; cleared when that call's [`Scope`] closes, before the borrow ends.
    hook: Option<*mut GradHook<'static>>,
}

thread_local! {
    /// The innermost open sink on this thread.
    static SINK: RefCell<Option<Sunk>> = const { RefCell::new(None) };
}

/// An open sink; closing it (drop) restores the enclosing one, so sinks nest. An inner sink
/// (a recomputed segment's backward) has no hook: its gradients reach the outer sink, and its
/// hook, when the segment's op offers them there.
struct Scope {
    outer: Option<Sunk>,
}

impl Scope {
    fn open(hook: Option<*mut GradHook<'static>>) -> Self {
        let sink = Sunk {
            grads: HashMap::new(),
            hook,
        };
        Self {
            outer: SINK.with(|s| s.borrow_mut().replace(sink)),
        }
    }

    /// What this sink collected, as `(leaf, gradient)` pairs.
    fn take(&self) -> Vec<(Tensor, Tensor)> {
        SINK.with(|s| {
            s.borrow_mut()
                .as_mut()
                .map(|s| std::mem::take(&mut s.grads))
        })
        .unwrap_or_default()
        .into_values()
        .collect()
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        let outer = self.outer.take();
        SINK.with(|s| *s.borrow_mut() = outer);
    }
}

thread_local! {
    /// How many [`forward_for_sink`] calls are running on this thread.
    static AHEAD: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Runs `forward` promising that the graph it builds will be differentiated with [`backward`]
/// (not candle's `backward`), as [`crate::Engine::step`] does with its forward closure. Under
/// that promise wick's block ops ([`crate::ops::pre_norm_stack`]) build one graph node with their
/// own backward, whose parameter gradients only a sink can take; without it they build the
/// per-op composition (same values). Calls nest; the promise holds for the calling thread only.
pub fn forward_for_sink<R>(forward: impl FnOnce() -> R) -> R {
    struct Ahead;
    impl Drop for Ahead {
        fn drop(&mut self) {
            AHEAD.with(|a| a.set(a.get() - 1));
        }
    }
    AHEAD.with(|a| a.set(a.get() + 1));
    let _ahead = Ahead;
    forward()
}

/// Whether the graph being built will be differentiated with [`backward`] (see
/// [`forward_for_sink`]).
pub(crate) fn sink_ahead() -> bool {
    AHEAD.with(|a| a.get() > 0)
}

/// candle's `loss.backward()` with leaf gradients written once (module docs): returns the same
/// gradients as `loss.backward()`, with less memory at the end of the backward.
///
/// Errors: those of candle's backward, and of adding a sink gradient to candle's for the same
/// leaf (shapes or dtypes that differ, which no supporting op produces).
pub fn backward(loss: &Tensor) -> Result<GradStore> {
    backward_in(loss, Scope::open(None))
}

/// [`backward`], calling `hook(leaf, gradient so far)` each time the sink takes a leaf's
/// gradient, while the backward runs: a leaf offered once by one op (each parameter of a
/// block op, of a linear layer) has its final gradient at that call, so the caller can start
/// work on it (data parallelism's bucket all-reduce, `dist::reduce`) while the rest
/// of the backward runs. Gradients that candle computes itself (ops outside wick's) are not
/// seen by the hook; they are in the returned store, added to the sunk ones where both exist.
///
/// Errors: those of [`backward`], and the hook's first error (the backward stops there).
pub fn backward_with(loss: &Tensor, hook: &mut GradHook<'_>) -> Result<GradStore> {
    let hook: *mut GradHook<'_> = hook;
    // SAFETY: only the lifetime bound of the trait object is erased. The pointer is stored in
    // the sink this call opens and is dropped with it when `backward_in` returns (the scope is
    // closed on every path), while `hook`'s borrow is still held; `offer` calls it with no
    // borrow of the sink held, and the hook cannot reach the pointer itself.
    let hook: *mut GradHook<'static> = unsafe { std::mem::transmute(hook) };
    backward_in(loss, Scope::open(Some(hook)))
}

fn backward_in(loss: &Tensor, scope: Scope) -> Result<GradStore> {
    let mut grads = loss.backward()?;
    for (leaf, g) in scope.take() {
        let g = match grads.remove(&leaf) {
            Some(prev) => (prev + g)?,
            None => g,
        };
        grads.insert(&leaf, g);
    }
    Ok(grads)
}

/// Offers `grad`, the gradient of `leaf` from one op, to the sink open on this thread.
/// Returns `Ok(None)` when the sink took it (the op then returns no gradient for `leaf` to
/// candle) or when `grad` is `None`, and `Ok(Some(grad))` back when no sink is open or `leaf`
/// is not a variable (an intermediate tensor's gradient must flow on through candle's graph).
///
/// Errors: a gradient whose shape or dtype is not the leaf's (an op's bug: candle's own add
/// would have failed on it too).
pub(crate) fn offer(leaf: &Tensor, grad: Option<Tensor>) -> Result<Option<Tensor>> {
    let Some(grad) = grad else {
        return Ok(None);
    };
    if !leaf.is_variable() {
        return Ok(Some(grad));
    }
    let taken = SINK.with(|s| {
        let mut s = s.borrow_mut();
        let Some(sink) = s.as_mut() else {
            return Ok(Err(grad));
        };
        if grad.dims() != leaf.dims() || grad.dtype() != leaf.dtype() {
            bail!(
                "grad_sink: a gradient of shape {:?} {:?} for a parameter of shape {:?} {:?} \
                 (internal error in the op that computed it)",
                grad.dims(),
                grad.dtype(),
                leaf.dims(),
                leaf.dtype()
            )
        }
        let so_far = match sink.grads.get_mut(&leaf.id()) {
            Some((_, g)) => {
                *g = (&*g + grad)?;
                g.clone()
            }
            None => {
                sink.grads.insert(leaf.id(), (leaf.clone(), grad.clone()));
                grad
            }
        };
        Ok(Ok((sink.hook.take(), so_far)))
    })?;
    match taken {
        Err(grad) => Ok(Some(grad)),
        Ok((hook, so_far)) => {
            if let Some(hook) = hook {
                // taken out of the sink while it runs, so that a backward inside the hook
                // cannot reach it again (no second `&mut` to it), and put back after
                struct PutBack(*mut GradHook<'static>);
                impl Drop for PutBack {
                    fn drop(&mut self) {
                        SINK.with(|s| {
                            if let Some(sink) = s.borrow_mut().as_mut() {
                                sink.hook = Some(self.0);
                            }
                        });
                    }
                }
                let _back = PutBack(hook);
                // SAFETY: see `backward_with`: the hook outlives the sink that holds it, no
                // borrow of the sink is held here, and the sink no longer holds the pointer
                unsafe { (*hook)(leaf, &so_far)? };
            }
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn offer_without_a_sink_hands_the_gradient_back() -> Result<()> {
        let v = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let g = Tensor::new(&[3f32, 4.0], &Device::Cpu)?;
        let back = offer(v.as_tensor(), Some(g))?.expect("no sink is open");
        assert_eq!(back.to_vec1::<f32>()?, vec![3.0, 4.0]);
        Ok(())
    }

    #[test]
    fn sinks_nest_and_keep_their_own_gradients() -> Result<()> {
        let v = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let g = |x: f32| Tensor::new(&[x, x], &Device::Cpu);
        let outer = Scope::open(None);
        assert!(offer(v.as_tensor(), Some(g(1.0)?))?.is_none());
        {
            let inner = Scope::open(None);
            assert!(offer(v.as_tensor(), Some(g(10.0)?))?.is_none());
            assert!(offer(v.as_tensor(), Some(g(20.0)?))?.is_none());
            let got = inner.take();
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].1.to_vec1::<f32>()?, vec![30.0, 30.0]);
        }
        let got = outer.take();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1.to_vec1::<f32>()?, vec![1.0, 1.0]);
        drop(outer);
        assert!(offer(v.as_tensor(), Some(g(1.0)?))?.is_some(), "closed");
        Ok(())
    }

    #[test]
    fn wick_ops_hand_their_parameter_gradients_to_an_open_sink() -> Result<()> {
        use crate::ops;
        let dev = Device::Cpu;
        let v = |shape: &[usize]| {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) / 10.0).collect();
            Var::from_tensor(&Tensor::from_vec(data, shape, &dev)?)
        };
        let (table, w, b, w2, b2, gain, shift) = (
            v(&[6, 4])?,
            v(&[4, 4])?,
            v(&[4])?,
            v(&[4, 4])?,
            v(&[4])?,
            v(&[4])?,
            v(&[4])?,
        );
        let ids = Tensor::new(&[[1u32, 2, 5]], &dev)?;
        let x = ops::embedding(&ids, table.as_tensor())?;
        let x = ops::layer_norm(&x, gain.as_tensor(), shift.as_tensor(), 1e-5)?;
        let h = ops::linear(&x, w.as_tensor(), Some(b.as_tensor()))?;
        let y = ops::gelu_linear(&h, w2.as_tensor(), b2.as_tensor())?;
        let loss = y.sqr()?.sum_all()?;
        let scope = Scope::open(None);
        let grads = loss.backward()?;
        let sunk = scope.take();
        let all = [&table, &w, &b, &w2, &b2, &gain, &shift];
        assert_eq!(sunk.len(), all.len(), "every parameter went to the sink");
        for p in all {
            assert!(grads.get(p).is_none(), "candle's store got a sunk gradient");
            assert!(sunk.iter().any(|(l, _)| l.id() == p.id()));
        }
        Ok(())
    }

    #[test]
    fn backward_with_shows_each_sunk_gradient_as_it_is_taken() -> Result<()> {
        use crate::ops;
        let dev = Device::Cpu;
        let w1 = Var::new(&[[1f32, 2.0], [3.0, 4.0]], &dev)?;
        let w2 = Var::new(&[[0.5f32, -1.0]], &dev)?;
        let x = Tensor::new(&[[1f32, -1.0]], &dev)?;
        // w1 is used twice: its gradient is complete at its second offer
        let h = ops::linear(
            &ops::linear(&x, w1.as_tensor(), None)?,
            w1.as_tensor(),
            None,
        )?;
        let loss = ops::linear(&h, w2.as_tensor(), None)?.sum_all()?;
        let mut seen: Vec<(TensorId, Tensor)> = Vec::new();
        let grads = backward_with(&loss, &mut |leaf, g| {
            seen.push((leaf.id(), g.clone()));
            Ok(())
        })?;
        let offers = |v: &Var| seen.iter().filter(|(id, _)| *id == v.id()).count();
        assert_eq!((offers(&w1), offers(&w2)), (2, 1));
        for v in [&w1, &w2] {
            let (_, last) = seen.iter().rev().find(|(id, _)| *id == v.id()).unwrap();
            let held = grads.get(v.as_tensor()).expect("a gradient");
            assert_eq!(
                last.id(),
                held.id(),
                "the last gradient seen is the one returned"
            );
        }
        // closed form: y = w2 w1 w1 x^T; dy/dw2 = (w1 w1 x^T)^T = [-3, -7]
        let g2: Vec<Vec<f32>> = grads.get(w2.as_tensor()).unwrap().to_vec2()?;
        assert_eq!(g2, vec![vec![-3.0, -7.0]]);
        // a hook's error stops the backward
        let e = backward_with(&loss, &mut |_, _| candle_core::bail!("stop")).unwrap_err();
        assert!(e.to_string().contains("stop"), "{e}");
        Ok(())
    }

    #[test]
    fn a_gradient_of_the_wrong_shape_is_an_error() -> Result<()> {
        let v = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let _scope = Scope::open(None);
        let e = offer(v.as_tensor(), Some(Tensor::new(&[1f32], &Device::Cpu)?)).unwrap_err();
        assert!(e.to_string().contains("internal error"), "{e}");
        Ok(())
    }

    #[test]
    fn an_intermediate_tensor_is_not_sunk() -> Result<()> {
        let v = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let y = (v.as_tensor() * 2.0)?;
        let _scope = Scope::open(None);
        assert!(offer(&y, Some(Tensor::new(&[1f32, 1.0], &Device::Cpu)?))?.is_some());
        Ok(())
    }
}
