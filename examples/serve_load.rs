//! Load generator for examples/serve.rs: `--clients` threads send requests at a total
//! `--rate` (requests/s, open loop: each client keeps its own schedule) for `--seconds`, with
//! an optional feedback stream (`--feedback-rate`) that keeps the trainer busy. Prints one
//! JSON line: latency p50/p90/p99/max (ms), throughput, errors, the versions seen, and from
//! /metrics the training steps per second and the last publication time.
//!
//! ```text
//! cargo run --release --example serve -- --model mnist --port 8080 &
//! cargo run --release --example serve_load -- --url http://127.0.0.1:8080 --model mnist \
//!     --rate 200 --seconds 20                        # without training
//! cargo run --release --example serve_load -- --url http://127.0.0.1:8080 --model mnist \
//!     --rate 200 --seconds 20 --feedback-rate 20     # with training
//! ```

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Model {
    Mnist,
    Llama,
}

#[derive(Parser, Debug)]
#[command(
    about = "Drive examples/serve with concurrent clients; print latency percentiles as JSON"
)]
struct Args {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Which routes to drive: mnist (/predict, /feedback) or llama (/v1/completions, /v1/feedback).
    #[arg(long, value_enum, default_value = "mnist")]
    model: Model,
    /// Concurrent client threads.
    #[arg(long, default_value_t = 16, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    clients: usize,
    /// Total request rate (requests/s) over all clients.
    #[arg(long, default_value_t = 100.0, allow_negative_numbers = true, value_parser = wick::cli::positive_f64)]
    rate: f64,
    /// Duration of the run.
    #[arg(long, default_value_t = 20.0, allow_negative_numbers = true, value_parser = wick::cli::positive_f64)]
    seconds: f64,
    /// Feedback requests per second during the run (0: no training load).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = wick::cli::non_negative_f64)]
    feedback_rate: f64,
    /// mnist: images per /predict request.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    batch: usize,
    /// mnist: labelled images per /feedback request.
    #[arg(long, default_value_t = 32, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    feedback_batch: usize,
    /// mnist: the data folder (test images are sent).
    #[arg(long, default_value = "data/mnist")]
    data_dir: PathBuf,
    /// llama: the prompt.
    #[arg(long, default_value = "The quick brown fox")]
    prompt: String,
    /// llama: max_tokens per completion.
    #[arg(long, default_value_t = 16, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    max_tokens: usize,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i]
}

/// `name value` of one unlabelled metric in a Prometheus text exposition.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

fn scrape(agent: &ureq::Agent, url: &str) -> Result<String> {
    Ok(agent
        .get(format!("{url}/metrics"))
        .call()?
        .body_mut()
        .read_to_string()?)
}

fn main() -> Result<()> {
    let a = Args::parse();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into();
    // request bodies
    let (predict_path, feedback_path, requests, feedbacks): (&str, &str, Vec<Value>, Vec<Value>) =
        match a.model {
            Model::Mnist => {
                let d = wick::data::mnist::load_dir(&a.data_dir).context("--data-dir")?;
                let images: Vec<Vec<f32>> = d.test_images.narrow(0, 0, 1000)?.to_vec2()?;
                let labels: Vec<u32> = d.test_labels.narrow(0, 0, 1000)?.to_vec1()?;
                let len = images.len();
                let chunk = move |k: usize, b: usize| (0..b).map(move |j| (k * b + j) % len);
                let req = (0..64)
                .map(|k| json!({ "images": chunk(k, a.batch).map(|i| &images[i]).collect::<Vec<_>>() }))
                .collect();
                let fb = (0..64)
                    .map(|k| {
                        let idx: Vec<usize> = chunk(k + 100, a.feedback_batch).collect();
                        json!({
                            "images": idx.iter().map(|&i| &images[i]).collect::<Vec<_>>(),
                            "labels": idx.iter().map(|&i| labels[i]).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                ("/predict", "/feedback", req, fb)
            }
            Model::Llama => {
                let req = vec![json!({ "prompt": a.prompt, "max_tokens": a.max_tokens })];
                let fb =
                    vec![json!({ "prompt": a.prompt, "completion": " jumps over the lazy dog." })];
                ("/v1/completions", "/v1/feedback", req, fb)
            }
        };
    let before = scrape(&agent, &a.url).context("GET /metrics (is the server running?)")?;
    let stop = Arc::new(AtomicBool::new(false));
    let feedback_sent = Arc::new(AtomicU64::new(0));
    let feedback_rejected = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(a.seconds);
    let feeder = (a.feedback_rate > 0.0).then(|| {
        let (agent, url, stop) = (agent.clone(), a.url.clone(), stop.clone());
        let (sent, rejected, rate) = (
            feedback_sent.clone(),
            feedback_rejected.clone(),
            a.feedback_rate,
        );
        std::thread::spawn(move || {
            let mut k = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let at = start + Duration::from_secs_f64(k as f64 / rate);
                if at >= deadline {
                    break;
                }
                std::thread::sleep(at.saturating_duration_since(Instant::now()));
                let body = &feedbacks[k as usize % feedbacks.len()];
                match agent.post(format!("{url}{feedback_path}")).send_json(body) {
                    Ok(r) if r.status() == 202 => sent.fetch_add(1, Ordering::Relaxed),
                    _ => rejected.fetch_add(1, Ordering::Relaxed),
                };
                k += 1;
            }
        })
    });
    let requests = Arc::new(requests);
    let clients: Vec<_> = (0..a.clients)
        .map(|c| {
            let (agent, url, requests) = (agent.clone(), a.url.clone(), requests.clone());
            let (n, rate) = (a.clients as u64, a.rate);
            std::thread::spawn(move || {
                let mut lat = Vec::new();
                let mut errors = Vec::new();
                let mut versions = BTreeSet::new();
                let mut k = c as u64;
                loop {
                    // behind schedule (a saturated server): send at once, but stop at the deadline
                    let at = start + Duration::from_secs_f64(k as f64 / rate);
                    if at >= deadline || Instant::now() >= deadline {
                        break;
                    }
                    std::thread::sleep(at.saturating_duration_since(Instant::now()));
                    let t = Instant::now();
                    let body = &requests[k as usize % requests.len()];
                    match agent.post(format!("{url}{predict_path}")).send_json(body) {
                        Ok(mut r) if r.status() == 200 => {
                            let v: Value = r.body_mut().read_json().unwrap_or(Value::Null);
                            lat.push(t.elapsed().as_secs_f64() * 1e3);
                            if let Some(ver) = v["version"].as_u64() {
                                versions.insert(ver);
                            }
                        }
                        Ok(r) => errors.push(format!("status {}", r.status())),
                        Err(e) => errors.push(e.to_string()),
                    }
                    k += n;
                }
                (lat, errors, versions)
            })
        })
        .collect();
    let (mut lat, mut errors, mut versions) = (Vec::new(), Vec::new(), BTreeSet::new());
    for c in clients {
        let (l, e, v) = c
            .join()
            .map_err(|_| anyhow::anyhow!("a client thread panicked"))?;
        lat.extend(l);
        errors.extend(e);
        versions.extend(v);
    }
    let wall = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    if let Some(f) = feeder {
        let _ = f.join();
    }
    let after = scrape(&agent, &a.url)?;
    lat.sort_by(f64::total_cmp);
    let steps = |t: &str| metric(t, "wick_serve_train_steps_total").unwrap_or(0.0);
    let delta = |n: &str| metric(&after, n).unwrap_or(0.0) - metric(&before, n).unwrap_or(0.0);
    let publishes = delta("wick_serve_publishes_total");
    let mean_publish_ms =
        (publishes > 0.0).then(|| delta("wick_serve_publish_seconds_sum") * 1e3 / publishes);
    let out = json!({
        "model": format!("{:?}", a.model).to_lowercase(),
        "clients": a.clients,
        "target_rate": a.rate,
        "feedback_rate": a.feedback_rate,
        "seconds": wall,
        "requests_ok": lat.len(),
        "errors": errors.len(),
        "first_error": errors.first(),
        "throughput_rps": lat.len() as f64 / wall,
        "latency_ms": {
            "p50": percentile(&lat, 0.5),
            "p90": percentile(&lat, 0.9),
            "p99": percentile(&lat, 0.99),
            "max": lat.last(),
            "mean": lat.iter().sum::<f64>() / lat.len().max(1) as f64,
        },
        "versions_seen": versions.len(),
        "feedback_accepted": feedback_sent.load(Ordering::Relaxed),
        "feedback_rejected": feedback_rejected.load(Ordering::Relaxed),
        "train_steps": steps(&after) - steps(&before),
        "train_steps_per_s": (steps(&after) - steps(&before)) / wall,
        "last_publish_ms": metric(&after, "wick_serve_publish_seconds").map(|s| s * 1e3),
        "mean_publish_ms": mean_publish_ms,
        "tokens_per_s_last": metric(&after, "wick_serve_tokens_per_second"),
        "tokens_per_s_basis": "the server's last completion: generated tokens / its wall-clock s (prompt prefill included); not trained tokens",
    });
    println!("{out}");
    Ok(())
}
