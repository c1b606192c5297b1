//! Parameter groups: an optimizer made of groups, each a selector over parameter names and
//! shapes and the rule (with its hyper-parameters) that updates what it selects, as
//! `torch.optim`'s parameter groups, and as `torch.optim.Muon` is meant to be used: Muon for the
//! 2-D weights of hidden layers, AdamW for embeddings, the head, norms and biases
//! ([`ParamGroups::muon_with_adamw`]).
//!
//! Each group runs its own optimizer (the element-wise [`super::Driver`] or the whole-tensor
//! [`super::TensorDriver`]) over the parameters it selects, in store order; a parameter belongs
//! to the first group that selects it, and one that no group selects is an error naming it.
//! Checkpoint names stay `"{param}.{state}"` (a parameter is in one group), so what `save`
//! writes, `load` takes, whichever group a parameter is in; ZeRO-1 ownership is per whole
//! parameter, handed to each group for its own parameters. Every group is validated before any
//! group steps; a runtime error inside one group's update (e.g. out of memory) leaves the
//! groups before it updated.

use super::{Impl, Optimizer, StepInputs};
use crate::params::Param;
use anyhow::{bail, ensure, Context, Result};
use candle_core::Tensor;
use std::collections::HashMap;

/// Which parameters a group selects: every condition holds.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Select {
    /// Name globs (`glob` syntax, as [`crate::ParamStore::set_weight_decay`]); the name must
    /// match one. Empty: any name.
    pub include: Vec<String>,
    /// Name globs the name must match none of.
    pub exclude: Vec<String>,
    /// The parameter's number of dimensions (`Some(2)`: matrices). `None`: any.
    pub rank: Option<usize>,
}

/// An optimizer rule with its hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum RuleConfig {
    /// AdamW (element-wise, fused paths).
    AdamW(super::AdamWConfig),
    /// SGD (element-wise, fused paths).
    Sgd(super::SgdConfig),
    /// Muon (whole-tensor; 2-D parameters only).
    Muon(super::MuonConfig),
}

/// One parameter group.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup {
    /// The group's name, in errors.
    pub name: String,
    /// The parameters it takes (those no earlier group took).
    pub select: Select,
    /// The rule that updates them.
    pub rule: RuleConfig,
    /// The group's learning rate as a multiple of the schedule's (PyTorch: a group whose `lr`
    /// is `lr_scale * base_lr` under the same schedule); multiplies each parameter's own
    /// [`crate::params::ParamOptions::lr_scale`]. Finite, >= 0.
    pub lr_scale: f64,
}

/// The groups of an optimizer, in selection order.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroups(pub Vec<ParamGroup>);

/// Name globs of the 2-D weights that are not hidden layers' in wick's models and
/// transformers' names: token and position embeddings and the output head.
pub const EMBEDDINGS_AND_HEAD: &[&str] = &["wte.*", "wpe.*", "*embed*", "*lm_head*", "head.*"];

impl ParamGroups {
    /// Muon for the 2-D weights of hidden layers (rank 2, not matching `not_hidden`, e.g.
    /// [`EMBEDDINGS_AND_HEAD`]), AdamW for everything else (embeddings, the head, norms,
    /// biases), as `torch.optim.Muon`'s documentation advises. Both at the schedule's rate;
    /// give the Muon group another with [`ParamGroups::with_lr_scale`].
    pub fn muon_with_adamw(
        muon: super::MuonConfig,
        adamw: super::AdamWConfig,
        not_hidden: &[&str],
    ) -> Self {
        ParamGroups(vec![
            ParamGroup {
                name: "muon".into(),
                select: Select {
                    include: Vec::new(),
                    exclude: not_hidden.iter().map(|s| s.to_string()).collect(),
                    rank: Some(2),
                },
                rule: RuleConfig::Muon(muon),
                lr_scale: 1.0,
            },
            ParamGroup {
                name: "adamw".into(),
                select: Select::default(),
                rule: RuleConfig::AdamW(adamw),
                lr_scale: 1.0,
            },
        ])
    }

    /// The same groups with group `name`'s learning-rate scale set to `scale`.
    ///
    /// Errors: no group of that name.
    pub fn with_lr_scale(mut self, name: &str, scale: f64) -> Result<Self> {
        let g = self.0.iter_mut().find(|g| g.name == name);
        let g = g.with_context(|| format!("no parameter group named {name:?}"))?;
        g.lr_scale = scale;
        Ok(self)
    }
}

/// A compiled [`Select`].
struct Selector {
    include: Vec<glob::Pattern>,
    exclude: Vec<glob::Pattern>,
    rank: Option<usize>,
}

impl Selector {
    fn new(s: &Select, group: &str) -> Result<Self> {
        let compile = |v: &[String]| {
            v.iter()
                .map(|p| {
                    glob::Pattern::new(p).with_context(|| {
                        format!("parameter group {group:?}: {p:?} is not a valid glob")
                    })
                })
                .collect::<Result<Vec<_>>>()
        };
        Ok(Self {
            include: compile(&s.include)?,
            exclude: compile(&s.exclude)?,
            rank: s.rank,
        })
    }

    fn takes(&self, p: &Param) -> bool {
        (self.include.is_empty() || self.include.iter().any(|g| g.matches(&p.name)))
            && !self.exclude.iter().any(|g| g.matches(&p.name))
            && self.rank.is_none_or(|r| r == p.master.rank())
    }
}

/// An optimizer made of [`ParamGroups`]; see the module docs.
pub struct Grouped {
    groups: Vec<(ParamGroup, Selector, Box<dyn Optimizer>)>,
    /// ZeRO-1: the parameters this rank updates, by store position (`None`: all).
    owned: Option<Vec<bool>>,
}

impl Grouped {
    /// The groups' optimizers, element-wise ones on implementation `imp`.
    ///
    /// Errors: no groups; an invalid glob; a group's `lr_scale` negative or not finite; a
    /// rule's hyper-parameters out of range (named by the rule).
    pub fn new(groups: &ParamGroups, imp: Impl) -> Result<Self> {
        ensure!(
            !groups.0.is_empty(),
            "an optimizer needs at least one parameter group"
        );
        let mut out = Vec::with_capacity(groups.0.len());
        for g in &groups.0 {
            ensure!(
                g.lr_scale.is_finite() && g.lr_scale >= 0.0,
                "parameter group {:?}: lr_scale must be finite and >= 0, got {}",
                g.name,
                g.lr_scale
            );
            let opt: Box<dyn Optimizer> = match &g.rule {
                RuleConfig::AdamW(c) => Box::new(super::AdamW::new(c.clone(), imp)?),
                RuleConfig::Sgd(c) => Box::new(super::Sgd::new(c.clone(), imp)?),
                RuleConfig::Muon(c) => Box::new(super::Muon::new(c.clone())?),
            };
            out.push((g.clone(), Selector::new(&g.select, &g.name)?, opt));
        }
        Ok(Self {
            groups: out,
            owned: None,
        })
    }

    /// The store positions of each group's parameters.
    ///
    /// Errors: a parameter no group selects (named, with its shape).
    fn split(&self, params: &[Param]) -> Result<Vec<Vec<usize>>> {
        let mut members = vec![Vec::new(); self.groups.len()];
        for (i, p) in params.iter().enumerate() {
            let Some(g) = self.groups.iter().position(|(_, s, _)| s.takes(p)) else {
                bail!(
                    "parameter {} (shape {:?}) is in no parameter group; add a group that \
                     selects it (a last group with Select::default() takes the rest)",
                    p.name,
                    p.master.dims()
                );
            };
            members[g].push(i);
        }
        Ok(members)
    }

    /// One group's share of `params` and `grads`, and its ownership.
    fn share(
        &self,
        idx: &[usize],
        params: &[Param],
        grads: &[Option<Tensor>],
    ) -> (Vec<Param>, Vec<Option<Tensor>>, Option<Vec<bool>>) {
        let ps = idx.iter().map(|&i| params[i].clone()).collect();
        let gs = idx
            .iter()
            .map(|&i| grads.get(i).cloned().flatten())
            .collect();
        let owned = self
            .owned
            .as_ref()
            .map(|o| idx.iter().map(|&i| o.get(i) == Some(&true)).collect());
        (ps, gs, owned)
    }

    fn check_slots(params: &[Param], grads: &[Option<Tensor>]) -> Result<()> {
        ensure!(
            grads.len() == params.len(),
            "optimizer step: {} gradient slots for {} parameters",
            grads.len(),
            params.len()
        );
        Ok(())
    }
}

impl Optimizer for Grouped {
    fn step(
        &mut self,
        params: &[Param],
        grads: &[Option<Tensor>],
        inputs: StepInputs,
    ) -> Result<Option<bool>> {
        let members = self.split(params)?;
        for (k, idx) in members.iter().enumerate() {
            let owned = self.share(idx, params, &[]).2;
            self.groups[k].2.set_owned(owned);
        }
        self.check(params, grads, &inputs)?; // every group, before any changes
        let mut applied = Some(true);
        for (k, idx) in members.iter().enumerate() {
            let (ps, gs, _) = self.share(idx, params, grads);
            let (group, _, opt) = &mut self.groups[k];
            let lr = inputs.lr * group.lr_scale;
            let got = opt.step(&ps, &gs, StepInputs { lr, ..inputs })?;
            applied = match (applied, got) {
                (Some(a), Some(b)) => Some(a && b),
                _ => None,
            };
        }
        Ok(applied)
    }

    fn check(&self, params: &[Param], grads: &[Option<Tensor>], inputs: &StepInputs) -> Result<()> {
        Self::check_slots(params, grads)?;
        let members = self.split(params)?;
        for ((group, _, opt), idx) in self.groups.iter().zip(&members) {
            let (ps, gs, _) = self.share(idx, params, grads);
            opt.check(&ps, &gs, inputs)
                .with_context(|| format!("parameter group {:?}", group.name))?;
        }
        Ok(())
    }

    fn needs_whole_tensors(&self) -> bool {
        self.groups.iter().any(|(_, _, o)| o.needs_whole_tensors())
    }

    fn writes_working_copies(&self) -> bool {
        self.groups
            .iter()
            .all(|(_, _, o)| o.writes_working_copies())
    }

    fn set_owned(&mut self, owned: Option<Vec<bool>>) {
        self.owned = owned;
    }

    fn state_tensors(&self, params: &[Param]) -> Result<Vec<(String, Tensor)>> {
        let members = self.split(params)?;
        let mut out = Vec::new();
        for ((_, _, opt), idx) in self.groups.iter().zip(&members) {
            let ps: Vec<Param> = idx.iter().map(|&i| params[i].clone()).collect();
            out.extend(opt.state_tensors(&ps)?);
        }
        Ok(out)
    }

    fn state_suffixes(&self) -> Vec<&'static str> {
        let mut v: Vec<&'static str> = Vec::new();
        for s in self.groups.iter().flat_map(|(_, _, o)| o.state_suffixes()) {
            if !v.contains(&s) {
                v.push(s);
            }
        }
        v
    }

    fn load_state_tensors(
        &mut self,
        params: &[Param],
        tensors: &HashMap<String, Tensor>,
        applied_steps: u64,
    ) -> Result<()> {
        let members = self.split(params)?;
        // each group's state before, to put back if a later group refuses its share
        let mut before = Vec::with_capacity(members.len());
        for ((_, _, opt), idx) in self.groups.iter().zip(&members) {
            let ps: Vec<Param> = idx.iter().map(|&i| params[i].clone()).collect();
            before.push(
                opt.state_tensors(&ps)?
                    .into_iter()
                    .collect::<HashMap<_, _>>(),
            );
        }
        for k in 0..members.len() {
            let (ps, _, owned) = self.share(&members[k], params, &[]);
            let opt = &mut self.groups[k].2;
            opt.set_owned(owned);
            if let Err(e) = opt.load_state_tensors(&ps, tensors, applied_steps) {
                for j in 0..k {
                    let (ps, _, _) = self.share(&members[j], params, &[]);
                    self.groups[j]
                        .2
                        .load_state_tensors(&ps, &before[j], applied_steps)?;
                }
                return Err(e.context(format!("parameter group {:?}", self.groups[k].0.name)));
            }
        }
        Ok(())
    }
}
