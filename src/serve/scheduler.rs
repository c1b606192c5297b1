//! Continuous batching (Orca, Yu et al. OSDI 2022; vLLM's scheduler): one engine thread owns
//! the model work and a paged KV cache, and every step runs the next token of every running
//! sequence and chunks of waiting prompts (chunked prefill, a per-step token budget) as one
//! batch. Sequences join and leave at every step.
//!
//! ```text
//! submit ──▶ waiting (bounded: full → SubmitError::Busy, a 429)
//!               │ admission: the blocks of prompt + max_tokens taken from the free list
//!               ▼
//!            running ──▶ step: decode tokens + prefill chunks ≤ step_tokens, one
//!               ▲         forward_paged per model version in the batch, sample per request
//!               └──────── finished (EOS, stop string, max_tokens, client gone): blocks freed
//! ```
//! A request names the model it runs on (`Arc<M>`: the snapshot the caller loaded from
//! [`super::Published`] when the request arrived), so its whole answer comes from one
//! version even while newer ones are published; sequences of different versions (or
//! adapters) in one step run as one forward each. Admission reserves every block the
//! request can need, so a running sequence never waits for memory and nothing is preempted.
//!
//! The engine thread is where a CUDA build will capture its decode graphs: nothing else
//! launches model work.

use super::sampling::{self, Cut, SamplingParams};
use crate::models::{BlockTable, CausalLm, PagedBatchEntry, PagedKvCache};
use anyhow::{bail, Context, Result};
use rand::{rngs::StdRng, SeedableRng};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Sizes of the cache, the batch and the queue.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Positions per KV-cache block (>= 1).
    pub block_size: usize,
    /// Blocks in the pool (>= 1): `block_size · num_blocks` positions for all sequences.
    pub num_blocks: usize,
    /// Most sequences running at once (>= 1, <= `step_tokens`).
    pub max_running: usize,
    /// Most requests waiting for admission (>= 1); beyond, [`SubmitError::Busy`].
    pub max_waiting: usize,
    /// Tokens per step, decode tokens and prefill chunks together (>= `max_running`).
    pub step_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 1024,
            max_running: 64,
            max_waiting: 256,
            step_tokens: 512,
        }
    }
}

impl SchedulerConfig {
    /// Checks the fields.
    ///
    /// Errors: a size 0, or `step_tokens < max_running` (a step could not hold every
    /// running sequence's decode token).
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_running", self.max_running),
            ("max_waiting", self.max_waiting),
            ("step_tokens", self.step_tokens),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            bail!("SchedulerConfig::{name} must be >= 1");
        }
        if self.step_tokens < self.max_running {
            bail!(
                "SchedulerConfig::step_tokens ({}) must be >= max_running ({}): every running \
                 sequence decodes a token per step",
                self.step_tokens,
                self.max_running
            );
        }
        Ok(())
    }
}

/// The text of token ids (a tokenizer's decode), for stop strings and streamed text.
pub type Detokenize = Arc<dyn Fn(&[u32]) -> Result<String> + Send + Sync>;

/// Why an answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// An end-of-sequence token (kept in the ids, not in the text) or a stop string.
    Stop,
    /// The receiver went away (its callback returned false).
    Cancelled,
}

impl FinishReason {
    /// OpenAI's `finish_reason`: `length`, `stop`, `cancelled`.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// What a request hears from the engine thread, in order: tokens, then `Done` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A new token and the text it adds (empty while an unfinished character or the start of
    /// a stop string is held back; no text without a [`Detokenize`]).
    Token {
        /// The token id.
        id: u32,
        /// New text.
        text: String,
    },
    /// The answer is complete; `text` is the rest held back until now.
    Done {
        /// Why it ended.
        reason: FinishReason,
        /// Text not sent with a token.
        text: String,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
    },
    /// The model failed on this request's batch (the message says how); nothing follows.
    Failed(String),
}

/// Receives a request's events on the engine thread; must not block. Returns false when
/// nobody listens any more (the request is then cancelled).
pub type OnEvent = Box<dyn FnMut(Event) -> bool + Send>;

/// A completion request.
pub struct Request<M> {
    /// The model (version, adapter) the whole answer is computed with.
    pub model: Arc<M>,
    /// Prompt token ids (>= 1).
    pub prompt: Vec<u32>,
    /// Sampling and stopping.
    pub params: SamplingParams,
    /// Where the events go.
    pub on_event: OnEvent,
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// `max_waiting` requests wait already: retry later (HTTP 429).
    Busy {
        /// Requests waiting.
        waiting: usize,
    },
    /// Prompt plus `max_tokens` need more KV positions than the whole cache has.
    TooLong {
        /// Positions needed.
        tokens: usize,
        /// Positions in the cache.
        capacity: usize,
    },
    /// A bad request (the message names the field).
    Invalid(String),
    /// The scheduler is shutting down or has stopped.
    Closed,
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::Busy { waiting } => write!(
                f,
                "{waiting} requests are waiting for the model already; retry later"
            ),
            SubmitError::TooLong { tokens, capacity } => write!(
                f,
                "prompt + max_tokens need {tokens} KV-cache positions; the cache holds \
                 {capacity}: shorten the prompt or max_tokens"
            ),
            SubmitError::Invalid(m) => f.write_str(m),
            SubmitError::Closed => f.write_str("the scheduler is shutting down"),
        }
    }
}

impl std::error::Error for SubmitError {}

/// Counters the engine thread updates (for `/metrics`).
#[derive(Debug, Default)]
pub struct SchedulerStats {
    steps: AtomicU64,
    generated: AtomicU64,
    prefilled: AtomicU64,
    running: AtomicUsize,
    waiting: AtomicUsize,
    free_blocks: AtomicUsize,
    last_batch: AtomicUsize,
}

impl SchedulerStats {
    /// Engine steps run.
    pub fn steps(&self) -> u64 {
        self.steps.load(Ordering::Relaxed)
    }
    /// Tokens generated.
    pub fn generated_tokens(&self) -> u64 {
        self.generated.load(Ordering::Relaxed)
    }
    /// Prompt tokens run through the model.
    pub fn prefilled_tokens(&self) -> u64 {
        self.prefilled.load(Ordering::Relaxed)
    }
    /// Sequences running.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }
    /// Requests waiting for admission.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }
    /// Free KV-cache blocks.
    pub fn free_blocks(&self) -> usize {
        self.free_blocks.load(Ordering::Relaxed)
    }
    /// Sequences in the last step's batch.
    pub fn last_batch(&self) -> usize {
        self.last_batch.load(Ordering::Relaxed)
    }
}

enum Msg<M> {
    Submit(Request<M>),
    Shutdown,
}

/// The handle of the engine thread: submit requests, read the counters, shut it down.
pub struct Scheduler<M> {
    tx: Sender<Msg<M>>,
    config: SchedulerConfig,
    detokenize: Option<Detokenize>,
    closed: AtomicBool,
    stats: Arc<SchedulerStats>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<M: CausalLm + 'static> Scheduler<M> {
    /// Starts the engine thread (`wick-scheduler`), which makes the paged cache for `model`
    /// (its shapes and dtype; any version of it can then run) and serves until
    /// [`Self::shutdown`]. `detokenize` gives the text of ids (needed for stop strings and
    /// streamed text).
    ///
    /// Errors: an invalid config; the cache could not be made (out of memory); the thread
    /// could not start.
    pub fn spawn(
        model: Arc<M>,
        config: SchedulerConfig,
        detokenize: Option<Detokenize>,
    ) -> Result<Self> {
        config.validate()?;
        let (tx, rx) = channel();
        let (ready_tx, ready_rx) = channel::<Result<()>>();
        let stats = Arc::new(SchedulerStats::default());
        let (cfg, st, detok) = (config.clone(), stats.clone(), detokenize.clone());
        let thread = std::thread::Builder::new()
            .name("wick-scheduler".into())
            .spawn(move || {
                let cache = match model.paged_cache(cfg.block_size, cfg.num_blocks) {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                drop(model);
                st.free_blocks.store(cache.free_blocks(), Ordering::Relaxed);
                let _ = ready_tx.send(Ok(()));
                Engine {
                    cache,
                    config: cfg,
                    detokenize: detok,
                    stats: st,
                    waiting: VecDeque::new(),
                    running: Vec::new(),
                }
                .run(rx)
            })
            .context("spawning the scheduler thread")?;
        ready_rx
            .recv()
            .context("the scheduler thread stopped while making its KV cache")?
            .context("making the paged KV cache")?;
        Ok(Self {
            tx,
            config,
            detokenize,
            closed: AtomicBool::new(false),
            stats,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues `request`; its events arrive through its callback on the engine thread.
    ///
    /// Errors (the callback is dropped unused): [`SubmitError::Invalid`] for an empty prompt,
    /// an id outside the vocabulary, bad sampling parameters, stop strings without a
    /// detokenizer, or prompt + `max_tokens` past `max_position_embeddings`;
    /// [`SubmitError::TooLong`] when they need more positions than the cache has;
    /// [`SubmitError::Busy`] when `max_waiting` requests wait; [`SubmitError::Closed`] after
    /// [`Self::shutdown`].
    pub fn submit(&self, request: Request<M>) -> Result<(), SubmitError> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(SubmitError::Closed);
        }
        let invalid = |m: String| Err(SubmitError::Invalid(m));
        let (p, config) = (&request.params, request.model.config());
        if let Err(e) = p.validate() {
            return invalid(format!("{e:#}"));
        }
        if request.prompt.is_empty() {
            return invalid("the prompt is empty; give at least one token".into());
        }
        if let Some(bad) = request
            .prompt
            .iter()
            .find(|&&i| i as usize >= config.vocab_size)
        {
            return invalid(format!(
                "prompt id {bad} is outside the vocabulary of {}",
                config.vocab_size
            ));
        }
        if !p.stop.is_empty() && self.detokenize.is_none() {
            return invalid("stop strings need a detokenizer; this scheduler has none".into());
        }
        let Some(total) = request.prompt.len().checked_add(p.max_tokens) else {
            return invalid(format!("max_tokens {} is too large", p.max_tokens));
        };
        if total > config.max_position_embeddings {
            return invalid(format!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the model's {} positions",
                request.prompt.len(),
                p.max_tokens,
                config.max_position_embeddings
            ));
        }
        let capacity = self.config.block_size * self.config.num_blocks;
        if total - 1 > capacity {
            return Err(SubmitError::TooLong {
                tokens: total - 1,
                capacity,
            });
        }
        let waiting = self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        if waiting >= self.config.max_waiting {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Busy { waiting });
        }
        self.tx.send(Msg::Submit(request)).map_err(|_| {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            SubmitError::Closed
        })
    }
}

impl<M> Scheduler<M> {
    /// The counters.
    pub fn stats(&self) -> &Arc<SchedulerStats> {
        &self.stats
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Stops accepting requests, lets the engine thread finish every accepted one, and waits
    /// for it. Later calls return at once.
    ///
    /// Errors: the engine thread panicked.
    pub fn shutdown(&self) -> Result<()> {
        self.closed.store(true, Ordering::SeqCst);
        let _ = self.tx.send(Msg::Shutdown);
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        match handle.map(JoinHandle::join) {
            Some(Err(_)) => bail!("the scheduler thread panicked"),
            _ => Ok(()),
        }
    }
}

impl<M> Drop for Scheduler<M> {
    fn drop(&mut self) {
        // the thread finishes what it accepted and exits; nobody waits for it
        let _ = self.tx.send(Msg::Shutdown);
    }
}

/// A running sequence.
struct Seq<M> {
    model: Arc<M>,
    prompt: Vec<u32>,
    out: Vec<u32>,
    /// Positions in the cache.
    fed: usize,
    table: BlockTable,
    params: SamplingParams,
    rng: StdRng,
    on_event: OnEvent,
    /// The answer's text so far, and how many of its bytes were sent.
    text: String,
    sent: usize,
}

impl<M: CausalLm> Seq<M> {
    /// The ids to run next, `n` of them: a prompt chunk, or the last sampled token.
    fn next_ids(&self, n: usize) -> &[u32] {
        match self.fed < self.prompt.len() {
            true => &self.prompt[self.fed..self.fed + n],
            false => &self.out[self.fed - self.prompt.len()..][..1],
        }
    }

    /// Samples the next token from `logits`, sends it, and says whether the answer ended.
    fn advance(
        &mut self,
        logits: &[f32],
        detokenize: Option<&Detokenize>,
    ) -> Result<Option<FinishReason>> {
        let p = &self.params;
        let id = sampling::sample(logits, p.temperature, p.top_p, &mut self.rng)?;
        self.out.push(id);
        let eos = self.model.config().is_eos(id);
        let mut stop = eos;
        let mut delta = String::new();
        if let Some(d) = detokenize {
            let text_ids = &self.out[..self.out.len() - eos as usize];
            self.text = d(text_ids)?;
            let end = match sampling::cut(&self.text, &p.stop) {
                Cut::Stop(i) => {
                    stop = true;
                    self.text.truncate(i);
                    i
                }
                Cut::Hold(j) => j,
            };
            delta = self.text.get(self.sent..end).unwrap_or("").to_string();
            self.sent = self.sent.max(end);
        }
        let listening = (self.on_event)(Event::Token { id, text: delta });
        Ok(if stop {
            Some(FinishReason::Stop)
        } else if self.out.len() >= p.max_tokens {
            Some(FinishReason::Length)
        } else if !listening {
            Some(FinishReason::Cancelled)
        } else {
            None
        })
    }

    fn finish(&mut self, reason: FinishReason) {
        let rest = self.text.get(self.sent..).unwrap_or("").to_string();
        (self.on_event)(Event::Done {
            reason,
            text: rest,
            prompt_tokens: self.prompt.len(),
            completion_tokens: self.out.len(),
        });
    }
}

struct Engine<M> {
    cache: PagedKvCache,
    config: SchedulerConfig,
    detokenize: Option<Detokenize>,
    stats: Arc<SchedulerStats>,
    waiting: VecDeque<Request<M>>,
    running: Vec<Seq<M>>,
}

impl<M: CausalLm> Engine<M> {
    fn run(mut self, rx: Receiver<Msg<M>>) {
        let mut open = true;
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                if !open {
                    break;
                }
                match rx.recv() {
                    Ok(m) => self.take(m, &mut open),
                    Err(_) => break,
                }
            }
            while let Ok(m) = rx.try_recv() {
                self.take(m, &mut open);
            }
            self.admit();
            if !self.running.is_empty() {
                self.step();
            }
            self.stats
                .running
                .store(self.running.len(), Ordering::Relaxed);
            self.stats
                .free_blocks
                .store(self.cache.free_blocks(), Ordering::Relaxed);
        }
    }

    fn take(&mut self, m: Msg<M>, open: &mut bool) {
        match m {
            Msg::Submit(r) => self.waiting.push_back(r),
            Msg::Shutdown => *open = false,
        }
    }

    /// Moves waiting requests to running, first come first served, while sequences and
    /// blocks allow (the first that does not fit waits, and the ones behind it with it).
    fn admit(&mut self) {
        while self.running.len() < self.config.max_running {
            let Some(r) = self.waiting.front() else { break };
            // the last sampled token is never run: prompt + max_tokens - 1 positions
            let Ok(table) = self
                .cache
                .allocate(r.prompt.len() + r.params.max_tokens - 1)
            else {
                break;
            };
            let Some(r) = self.waiting.pop_front() else {
                break;
            };
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            self.running.push(Seq {
                rng: StdRng::seed_from_u64(r.params.seed),
                model: r.model,
                prompt: r.prompt,
                out: Vec::new(),
                fed: 0,
                table,
                params: r.params,
                on_event: r.on_event,
                text: String::new(),
                sent: 0,
            });
            self.stats
                .running
                .store(self.running.len(), Ordering::Relaxed);
        }
    }

    /// One step: the plan (decode tokens, then prefill chunks within the budget), one forward
    /// per model in it, a token for each sequence whose prompt is done, finished ones out.
    fn step(&mut self) {
        let decodes = self
            .running
            .iter()
            .filter(|s| s.fed >= s.prompt.len())
            .count();
        let mut budget = self.config.step_tokens.saturating_sub(decodes);
        let mut groups: Vec<Vec<(usize, usize)>> = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            let n = match s.fed >= s.prompt.len() {
                true => 1,
                false if budget > 0 => {
                    let n = (s.prompt.len() - s.fed).min(budget);
                    budget -= n;
                    n
                }
                false => continue,
            };
            let same =
                |g: &&mut Vec<(usize, usize)>| Arc::ptr_eq(&self.running[g[0].0].model, &s.model);
            match groups.iter_mut().find(same) {
                Some(g) => g.push((i, n)),
                None => groups.push(vec![(i, n)]),
            }
        }
        let mut ended: Vec<(usize, Option<FinishReason>)> = Vec::new();
        for group in &groups {
            // a panic inside the model fails this group's requests, not the engine thread
            let result =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.forward(group)))
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("the model panicked on this batch")));
            match result {
                Ok(rows) => {
                    for (&(i, n), row) in group.iter().zip(rows) {
                        let s = &mut self.running[i];
                        let prefill = s.fed < s.prompt.len();
                        s.fed += n;
                        if prefill {
                            self.stats.prefilled.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        if s.fed < s.prompt.len() {
                            continue; // a prompt chunk before the last: no token yet
                        }
                        self.stats.generated.fetch_add(1, Ordering::Relaxed);
                        match s.advance(&row, self.detokenize.as_ref()) {
                            Ok(None) => {}
                            Ok(Some(reason)) => ended.push((i, Some(reason))),
                            Err(e) => {
                                (s.on_event)(Event::Failed(format!("{e:#}")));
                                ended.push((i, None));
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!("scheduler: a batch of {} failed: {e:#}", group.len());
                    for &(i, _) in group {
                        (self.running[i].on_event)(Event::Failed(format!("{e:#}")));
                        ended.push((i, None));
                    }
                }
            }
        }
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        self.stats
            .last_batch
            .store(groups.iter().map(Vec::len).sum(), Ordering::Relaxed);
        ended.sort_by_key(|e| std::cmp::Reverse(e.0));
        let mut done = Vec::with_capacity(ended.len());
        for (i, reason) in ended {
            let mut s = self.running.remove(i);
            self.cache.release(std::mem::take(&mut s.table));
            done.push((s, reason));
        }
        // the counters first: whoever hears `Done` sees the sequence gone from them
        self.stats
            .running
            .store(self.running.len(), Ordering::Relaxed);
        self.stats
            .free_blocks
            .store(self.cache.free_blocks(), Ordering::Relaxed);
        for (mut s, reason) in done {
            if let Some(reason) = reason {
                s.finish(reason);
            }
        }
    }

    /// The logits rows of one group's sequences (one model).
    fn forward(&self, group: &[(usize, usize)]) -> Result<Vec<Vec<f32>>> {
        let entries: Vec<PagedBatchEntry<'_>> = group
            .iter()
            .map(|&(i, n)| {
                let s = &self.running[i];
                PagedBatchEntry {
                    ids: s.next_ids(n),
                    start: s.fed,
                    table: &s.table,
                }
            })
            .collect();
        let model = &self.running[group[0].0].model;
        let logits = model.forward_paged(&entries, &self.cache)?;
        Ok(logits.to_vec2::<f32>()?)
    }
}
