//! examples/serve.rs end to end, over real HTTP on 127.0.0.1: the MNIST model learns a
//! relabelled class from feedback; 20 concurrent clients x 200 requests while it trains get
//! answers that each match the weights of the version they name (recomputed here from that
//! version's tensors, in plain f32 loops); SIGTERM mid-training exits 143 and leaves a
//! checkpoint that loads; bad requests get the right 4xx with a JSON error; a full feedback
//! queue answers 429; a panicking handler answers 500 and the server goes on; a tiny Llama
//! with a LoRA adapter learns a repeated completion, streams it and serves it as a named
//! adapter; the OpenAI routes answer concurrent requests (batched by the scheduler) as they
//! answer each alone, stream chat, stop at stop strings and refuse what they do not implement; flags out of range are refused naming the flag. Loops are bounded; nothing asserts
//! on time, and no assertion depends on how the trainer thread and the requests interleave.

#![cfg(all(feature = "cli", feature = "tokenizers"))]

mod common;

use common::tmp;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A running `serve` example and an HTTP client for it.
struct Server {
    child: Child,
    base: String,
    agent: ureq::Agent,
    stdout: std::sync::Mutex<mpsc::Receiver<String>>,
    /// The stderr lines so far (also echoed to the test's stderr); complete after the exit.
    stderr: Option<std::thread::JoinHandle<Vec<String>>>,
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(180)))
        .build()
        .into()
}

impl Server {
    fn start(args: &[&str]) -> Server {
        let mut child = Command::new(common::example("serve"))
            .args(args)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting examples/serve");
        let err = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut lines = Vec::new();
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("[serve] {line}");
                lines.push(line);
            }
            lines
        });
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let first = rx
            .recv_timeout(Duration::from_secs(300))
            .expect("the server printed no address (it exited or hung)");
        let addr = first
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"));
        Server {
            child,
            base: addr.to_string(),
            agent: agent(),
            stdout: std::sync::Mutex::new(rx),
            stderr: Some(stderr),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let mut r = self
            .agent
            .post(&self.url(path))
            .send_json(body)
            .expect("POST");
        let status = r.status().as_u16();
        (status, r.body_mut().read_json().unwrap_or(Value::Null))
    }

    fn post_raw(&self, path: &str, content_type: Option<&str>, body: &[u8]) -> (u16, Value) {
        self.try_post_raw(path, content_type, body).expect("POST")
    }

    fn try_post_raw(
        &self,
        path: &str,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Result<(u16, Value), ureq::Error> {
        let mut req = self.agent.post(&self.url(path));
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        let mut r = req.send(body)?;
        let status = r.status().as_u16();
        Ok((status, r.body_mut().read_json().unwrap_or(Value::Null)))
    }

    fn get(&self, path: &str) -> (u16, Vec<u8>) {
        let mut r = self.agent.get(&self.url(path)).call().expect("GET");
        let status = r.status().as_u16();
        let body = r
            .body_mut()
            .with_config()
            .limit(1 << 30)
            .read_to_vec()
            .expect("body");
        (status, body)
    }

    fn get_json(&self, path: &str) -> (u16, Value) {
        let (s, b) = self.get(path);
        (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }

    fn health(&self) -> Value {
        self.get_json("/health").1
    }

    /// Polls /health (bounded) until `pred` holds; panics after `tries` polls.
    fn wait_for(&self, what: &str, tries: usize, pred: impl Fn(&Value) -> bool) -> Value {
        for _ in 0..tries {
            let h = self.health();
            if pred(&h) {
                return h;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("{what}: not reached; last /health {}", self.health());
    }

    /// Sends SIGTERM and waits (bounded) for the exit; returns the code, the stdout lines and
    /// the stderr lines.
    fn terminate(mut self) -> (Option<i32>, Vec<String>, Vec<String>) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        for _ in 0..1200 {
            if let Some(status) = self.child.try_wait().expect("wait") {
                let lines: Vec<String> = self.stdout.lock().unwrap().try_iter().collect();
                // the process is gone: its stderr ends, and the reader thread with it
                let err = self.stderr.take().unwrap().join().unwrap();
                return (status.code(), lines, err);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the server did not exit within 120 s of SIGTERM");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The first `n` MNIST training images of digit `digit` (pixels 0..1) and the next `n` of it.
fn digits(digit: u32, n: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mnist");
    let data = wick::data::mnist::load_dir(&root).expect("data/mnist (scripts/fetch_mnist.sh)");
    let images: Vec<Vec<f32>> = data
        .train_images
        .narrow(0, 0, 5000)
        .unwrap()
        .to_vec2()
        .unwrap();
    let labels: Vec<u32> = data
        .train_labels
        .narrow(0, 0, 5000)
        .unwrap()
        .to_vec1()
        .unwrap();
    let mut of: Vec<Vec<f32>> = images
        .into_iter()
        .zip(labels)
        .filter(|(_, l)| *l == digit)
        .map(|(x, _)| x)
        .take(2 * n)
        .collect();
    let held = of.split_off(n);
    (of, held)
}

fn classes(v: &Value) -> Vec<u64> {
    v["classes"]
        .as_array()
        .expect("classes")
        .iter()
        .map(|c| c.as_u64().unwrap())
        .collect()
}

fn error_message(status: u16, v: &Value) -> String {
    assert_eq!(v["error"]["status"].as_u64(), Some(status as u64), "{v}");
    let m = v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(!m.is_empty(), "{v}");
    m
}

/// Posts feedback, retrying (bounded) while the queue answers 429.
fn feed(s: &Server, path: &str, body: &Value) {
    for _ in 0..600 {
        let (status, v) = s.post(path, body);
        match status {
            202 => return,
            429 => std::thread::sleep(Duration::from_millis(50)),
            _ => panic!("feedback answered {status}: {v}"),
        }
    }
    panic!("the feedback queue stayed full");
}

#[test]
fn mnist_learns_a_relabelled_class_from_feedback() {
    let s = Server::start(&[
        "--model",
        "mnist",
        "--hidden",
        "64",
        "--precision",
        "32",
        "--lr",
        "3e-3",
        "--train-batch",
        "32",
    ]);
    let (threes, _) = digits(3, 64);
    let (status, before) = s.post("/predict", &json!({ "images": threes }));
    assert_eq!(status, 200, "{before}");
    assert_eq!(before["version"], 0);
    let sevens_before = classes(&before).iter().filter(|&&c| c == 7).count();
    assert!(
        sevens_before < 32,
        "the untrained model already says 7 for {sevens_before}/64"
    );

    // relabel these 3s as 7s, 20 times over (1280 examples)
    let labels = vec![7; threes.len()];
    for _ in 0..20 {
        feed(
            &s,
            "/feedback",
            &json!({ "images": threes, "labels": labels }),
        );
    }
    // every example trained on and the last step published (the trainer is idle): the answer
    // below comes from the weights after all 1280 examples, however they were batched
    let h = s.wait_for("all feedback trained on and published", 1200, |h| {
        h["queue_depth"] == 0 && h["train_examples"] == 1280 && h["version"] == h["train_steps"]
    });
    assert!(h["train_steps"].as_u64().unwrap() >= 40, "{h}");
    let (status, after) = s.post("/predict", &json!({ "images": threes }));
    assert_eq!(status, 200, "{after}");
    let sevens_after = classes(&after).iter().filter(|&&c| c == 7).count();
    assert!(
        sevens_after >= 58,
        "after feedback only {sevens_after}/64 are 7 ({h})"
    );
    assert!(after["version"].as_u64().unwrap() >= 1, "{after}");
    // probabilities are a distribution over 10 classes
    for row in after["probabilities"].as_array().unwrap() {
        let p: Vec<f64> = row
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(p.len(), 10);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-4, "{p:?}");
    }
}

/// The MLP 784-H-H-10 of a snapshot, in plain f32 loops: softmax probabilities of `x`.
struct Mlp {
    layers: Vec<(Vec<Vec<f32>>, Vec<f32>)>,
}

impl Mlp {
    fn from_safetensors(bytes: &[u8]) -> Mlp {
        let t = candle_core::safetensors::load_buffer(bytes, &candle_core::Device::Cpu).unwrap();
        let layer = |n: &str| {
            let w = t[&format!("{n}.weight")]
                .to_dtype(candle_core::DType::F32)
                .unwrap();
            let b = t[&format!("{n}.bias")]
                .to_dtype(candle_core::DType::F32)
                .unwrap();
            (w.to_vec2::<f32>().unwrap(), b.to_vec1::<f32>().unwrap())
        };
        Mlp {
            layers: vec![layer("l1"), layer("l2"), layer("l3")],
        }
    }

    fn probabilities(&self, x: &[f32]) -> Vec<f32> {
        let mut h: Vec<f32> = x.to_vec();
        for (i, (w, b)) in self.layers.iter().enumerate() {
            let mut y: Vec<f32> = w
                .iter()
                .zip(b)
                .map(|(row, bias)| row.iter().zip(&h).map(|(a, b)| a * b).sum::<f32>() + bias)
                .collect();
            if i + 1 < self.layers.len() {
                y.iter_mut().for_each(|v| *v = v.max(0.0));
            }
            h = y;
        }
        let m = h.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = h.iter().map(|v| (v - m).exp()).collect();
        let z: f32 = e.iter().sum();
        e.iter().map(|v| v / z).collect()
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn concurrent_answers_each_come_from_one_consistent_version() {
    let s = Server::start(&[
        "--model",
        "mnist",
        "--hidden",
        "32",
        "--precision",
        "32",
        "--lr",
        "1e-2",
        "--train-batch",
        "8",
        "--keep-versions",
        "100000",
    ]);
    let (images, _) = digits(5, 8);
    let done = std::sync::atomic::AtomicBool::new(false);
    // (client, request, version, first image index, probabilities)
    let mut answers: Vec<(u64, usize, Vec<Vec<f32>>)> = Vec::new();
    let mut errors = Vec::new();
    std::thread::scope(|scope| {
        // feedback while the clients run: one request, then wait for its version (bounded)
        let trainer = scope.spawn(|| {
            for i in 0..1000 {
                if done.load(std::sync::atomic::Ordering::SeqCst) && i >= 2 {
                    break;
                }
                let v0 = s.health()["version"].as_u64().unwrap();
                let labels: Vec<u32> = (0..images.len() as u32).map(|k| (k + i) % 10).collect();
                feed(
                    &s,
                    "/feedback",
                    &json!({ "images": images, "labels": labels }),
                );
                s.wait_for("a new version", 600, |h| {
                    h["version"].as_u64().unwrap() > v0
                });
            }
        });
        let clients: Vec<_> = (0..20)
            .map(|c| {
                let (images, s) = (&images, &s);
                scope.spawn(move || {
                    let mut out: Vec<(u64, usize, Vec<Vec<f32>>)> = Vec::new();
                    let mut errs = Vec::new();
                    for r in 0..200 {
                        // the last request waits for a version newer than the client's first
                        // answer: every client sees two versions, however the threads run
                        if let (199, Some(first)) = (r, out.first()) {
                            let first: u64 = first.0;
                            s.wait_for("a version newer than a client's first answer", 600, |h| {
                                h["version"].as_u64().unwrap() > first
                            });
                        }
                        let start = (c + r) % images.len();
                        let n = 1 + (r % 3);
                        let batch: Vec<&Vec<f32>> =
                            images.iter().cycle().skip(start).take(n).collect();
                        let (status, v) = s.post("/predict", &json!({ "images": batch }));
                        if status != 200 {
                            errs.push(format!("client {c} request {r}: {status} {v}"));
                            continue;
                        }
                        let probs: Vec<Vec<f32>> =
                            serde_json::from_value(v["probabilities"].clone()).unwrap();
                        out.push((v["version"].as_u64().unwrap(), start, probs));
                    }
                    (out, errs)
                })
            })
            .collect();
        for c in clients {
            let (out, errs) = c.join().unwrap();
            answers.extend(out);
            errors.extend(errs);
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        trainer.join().unwrap();
    });
    assert!(
        errors.is_empty(),
        "{} errors, first: {}",
        errors.len(),
        errors[0]
    );
    assert_eq!(answers.len(), 20 * 200);

    let versions: BTreeMap<u64, usize> = answers.iter().fold(BTreeMap::new(), |mut m, a| {
        *m.entry(a.0).or_default() += 1;
        m
    });
    assert!(
        versions.len() >= 2,
        "the clients saw one version only: {versions:?}"
    );
    // every version seen and the one before it, from the server's retained snapshots
    let mut models: HashMap<u64, Mlp> = HashMap::new();
    for &v in versions.keys() {
        for v in [v, v.saturating_sub(1)] {
            if let std::collections::hash_map::Entry::Vacant(e) = models.entry(v) {
                let (status, bytes) = s.get(&format!("/v1/snapshots/{v}"));
                assert_eq!(status, 200, "version {v} is not retained");
                e.insert(Mlp::from_safetensors(&bytes));
            }
        }
    }
    let mut discriminated = 0;
    for (version, start, probs) in &answers {
        for (k, p) in probs.iter().enumerate() {
            let x = &images[(start + k) % images.len()];
            let expect = models[version].probabilities(x);
            let d = max_diff(p, &expect);
            assert!(
                d < 1e-4,
                "version {version}: the answer differs from that version's weights by {d}"
            );
            if *version > 0 {
                let other = models[&(version - 1)].probabilities(x);
                if max_diff(p, &other) > 1e-3 {
                    discriminated += 1;
                }
            }
        }
    }
    eprintln!(
        "{} answers over {} versions; {discriminated} image answers differ from the previous version's",
        answers.len(),
        versions.len()
    );
    // the check tells versions apart: answers of a version differ from the previous version's
    assert!(
        discriminated > 0,
        "no answer differed from its previous version's: {versions:?}"
    );
}

#[test]
fn sigterm_mid_training_saves_a_checkpoint_that_loads() {
    let dir = tmp("sigterm");
    let save = dir.join("ckpt");
    let s = Server::start(&[
        "--model",
        "mnist",
        "--hidden",
        "32",
        "--precision",
        "32",
        "--train-batch",
        "4",
        "--checkpoint-every",
        "0",
        "--save-dir",
        save.to_str().unwrap(),
    ]);
    let (images, _) = digits(2, 32);
    for _ in 0..8 {
        feed(
            &s,
            "/feedback",
            &json!({ "images": images, "labels": vec![2; 32] }),
        );
    }
    s.wait_for("training started", 600, |h| {
        h["train_steps"].as_u64().unwrap() >= 1
    });
    let (code, lines, err) = s.terminate();
    assert_eq!(code, Some(143), "exit code after SIGTERM; stdout {lines:?}");
    assert!(
        err.iter().any(|l| l.contains("then saving a checkpoint")),
        "{err:?}"
    );
    let last = lines
        .iter()
        .find(|l| l.starts_with("stopped:"))
        .expect("a stopped: line");
    let steps: u64 = last.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(steps >= 1, "{last}");

    let path = wick::checkpoint::latest(&save)
        .unwrap()
        .expect("a checkpoint");
    assert!(
        last.contains(&path.display().to_string()),
        "{last} vs {}",
        path.display()
    );
    let store = wick::ParamStore::new(wick::Precision::Fp32, candle_core::Device::Cpu, 1);
    for (n, i, o) in [("l1", 784, 32), ("l2", 32, 32), ("l3", 32, 10)] {
        wick::nn::Linear::new(&store, n, i, o, true).unwrap();
    }
    let mut engine = wick::Engine::new(store, wick::EngineConfig::adamw(1e-3)).unwrap();
    let extra = wick::checkpoint::load(&path, &mut engine)
        .expect("the checkpoint loads")
        .extra;
    assert_eq!(
        engine.boundaries(),
        steps,
        "checkpoint step vs steps trained"
    );
    let version = extra["published_version"].as_u64().unwrap();
    assert!(version >= 1, "{extra}");

    // a restart resumes it: the same weights answer, under the version they had
    let s = Server::start(&[
        "--model",
        "mnist",
        "--hidden",
        "32",
        "--precision",
        "32",
        "--save-dir",
        save.to_str().unwrap(),
    ]);
    let (status, v) = s.post("/predict", &json!({ "images": [images[0]] }));
    assert_eq!((status, v["version"].as_u64()), (200, Some(version)), "{v}");
    let (status, bytes) = s.get(&format!("/v1/snapshots/{version}"));
    assert_eq!(status, 200);
    let served = candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu).unwrap();
    for (name, master) in engine.store().masters() {
        let a: Vec<f32> = master.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = served[&name].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a, b, "{name}: served weights differ from the checkpoint's");
    }
}

#[test]
fn bad_requests_get_a_json_4xx_naming_the_problem() {
    let s = Server::start(&[
        "--model",
        "mnist",
        "--hidden",
        "16",
        "--max-batch",
        "4",
        "--body-limit",
        "100000",
        "--debug-routes",
    ]);
    let row = vec![0.5f32; 784];
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        (
            "/predict",
            json!({ "images": [vec![0.5f32; 783]] }),
            422,
            "784",
        ),
        (
            "/predict",
            json!({ "images": [["a"]] }),
            422,
            "invalid type",
        ),
        ("/predict", json!({ "pictures": [row] }), 422, "pictures"),
        ("/predict", json!({ "images": [] }), 422, "empty"),
        (
            "/predict",
            json!({ "images": vec![row.clone(); 5] }),
            422,
            "at most 4",
        ),
        (
            "/feedback",
            json!({ "images": [row], "labels": [10] }),
            422,
            "labels[0]",
        ),
        (
            "/feedback",
            json!({ "images": [row], "labels": [1, 2] }),
            422,
            "one label per image",
        ),
        (
            "/feedback",
            json!({ "images": [row], "labels": ["x"] }),
            422,
            "invalid type",
        ),
    ];
    for (path, body, status, needle) in cases {
        let (got, v) = s.post(path, &body);
        assert_eq!(got, status, "{path} {body}: {v}");
        let m = error_message(status, &v);
        assert!(m.contains(needle), "{path}: {m:?} does not name {needle:?}");
    }
    let (got, v) = s.post_raw("/predict", Some("application/json"), b"{not json");
    assert_eq!(got, 400, "{v}");
    error_message(400, &v);
    let (got, v) = s.post_raw("/predict", None, br#"{"images": []}"#);
    assert_eq!(got, 415, "{v}");
    error_message(415, &v);
    let big = serde_json::to_vec(&json!({ "images": vec![row.clone(); 60] })).unwrap();
    assert!(big.len() > 100_000);
    // the server may answer 413 from the headers and close the connection while the client is
    // still writing the body (a broken pipe or reset, more likely on a loaded machine): that
    // attempt says nothing either way, so try again for the answer
    let (got, v) = (0..10)
        .find_map(|_| {
            s.try_post_raw("/predict", Some("application/json"), &big)
                .ok()
        })
        .expect("10 oversized POSTs all ended in a transport error");
    assert_eq!(got, 413, "{v}");
    assert!(error_message(413, &v).contains("size limit"), "{v}");
    let (got, v) = s.post("/nowhere", &json!({}));
    assert_eq!(got, 404, "{v}");
    assert!(error_message(404, &v).contains("/nowhere"));
    let (got, v) = s.get_json("/predict");
    assert_eq!(got, 405, "{v}");
    error_message(405, &v);
    let (got, v) = s.get_json("/v1/snapshots/999");
    assert_eq!(got, 404, "{v}");
    assert!(error_message(404, &v).contains("999"));
    for bad in ["abc", "-1", "1.5"] {
        let (got, v) = s.get_json(&format!("/v1/snapshots/{bad}"));
        assert_eq!(got, 400, "{bad}: {v}");
        let m = error_message(400, &v);
        assert!(m.contains(bad) && m.contains("whole number"), "{m}");
    }
    // a panic in a handler: 500 with a JSON error, and the server answers the next request
    let (got, v) = s.get_json("/debug/panic");
    assert_eq!(got, 500, "{v}");
    assert!(error_message(500, &v).contains("panicked"));
    let (got, ok) = s.post("/predict", &json!({ "images": [row] }));
    assert_eq!(got, 200, "{ok}");
    let (got, metrics) = s.get("/metrics");
    assert_eq!(got, 200);
    let text = String::from_utf8(metrics).unwrap();
    for name in [
        "wick_serve_request_latency_seconds_bucket",
        "wick_serve_weights_version",
        "wick_serve_feedback_queue_depth",
        "wick_serve_train_steps_total",
        "wick_serve_train_loss",
        "wick_serve_publish_seconds_sum",
        "wick_serve_publishes_total",
    ] {
        assert!(text.contains(name), "/metrics lacks {name}:\n{text}");
    }
}

#[test]
fn a_full_feedback_queue_answers_429() {
    // a trainer that rests 1000x its step time: the queue of 4 cannot drain between requests
    let s = Server::start(&[
        "--model",
        "mnist",
        "--hidden",
        "16",
        "--queue-capacity",
        "4",
        "--train-batch",
        "1",
        "--train-share",
        "0.001",
    ]);
    let (images, _) = digits(1, 64);
    // more examples than the queue can ever hold: 422, not a 429 that says "retry later"
    let (status, v) = s.post(
        "/feedback",
        &json!({ "images": images, "labels": vec![1; 64] }),
    );
    assert_eq!(status, 422, "{v}");
    assert!(error_message(422, &v).contains("--queue-capacity"), "{v}");
    // requests of 2 fill it: the trainer takes one example, then rests for 1000x its step
    let two = json!({ "images": images[..2], "labels": [1, 1] });
    let answers: Vec<(u16, Value)> = (0..10).map(|_| s.post("/feedback", &two)).collect();
    let (status, v) = answers
        .iter()
        .find(|(status, _)| *status != 202)
        .unwrap_or_else(|| panic!("10 requests of 2 into a queue of 4 were all accepted"));
    assert_eq!(*status, 429, "{v}");
    let m = error_message(429, v);
    assert!(m.contains("full"), "{m}");
    let depth = s.health()["queue_depth"].as_u64().unwrap();
    assert!(depth <= 4, "queue depth {depth} over its capacity 4");

    // no --save-dir: the shutdown says nothing is saved, and saves nothing
    let (code, lines, err) = s.terminate();
    assert_eq!(code, Some(143), "{lines:?} {err:?}");
    let signal = err
        .iter()
        .find(|l| l.starts_with("signal 15"))
        .unwrap_or_else(|| panic!("no signal line: {err:?}"));
    assert!(
        signal.contains("no --save-dir") && !signal.contains("then saving"),
        "{signal}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("stopped:") && l.ends_with("checkpoint none (no --save-dir)")),
        "{lines:?}"
    );
}

#[test]
fn tiny_llama_learns_a_repeated_completion_and_serves_it_as_an_adapter() {
    let adapters = tmp("adapters");
    // --train-batch 1: each feedback example is one optimizer step, so the weights of version
    // n are those after n identical examples, whatever the timing of requests and trainer
    let s = Server::start(&[
        "--model",
        "llama",
        "--tiny",
        "--lr",
        "1e-2",
        "--train-batch",
        "1",
        "--adapters-dir",
        adapters.to_str().unwrap(),
    ]);
    let prompt = "The capital of Wick is";
    let target = " Candleburg, by the sea.";
    let ask = json!({ "prompt": prompt, "max_tokens": 8 });
    let (status, before) = s.post("/v1/completions", &ask);
    assert_eq!(status, 200, "{before}");
    assert_eq!(
        (before["adapter"].as_str(), before["version"].as_u64()),
        (Some("live"), Some(0))
    );
    assert_ne!(
        before["choices"][0]["text"], target,
        "the untrained model already completes it"
    );

    // one example at a time: wait until it is trained and published (n steps, version n,
    // nothing queued: the trainer is idle and stays idle until the next example), then ask
    // version n. The first version that answers the target is the one every check below uses.
    let feedback = json!({ "prompt": prompt, "completion": target });
    let mut after = Value::Null;
    for n in 1..=60u64 {
        feed(&s, "/v1/feedback", &feedback);
        let h = s.wait_for("the example trained on and published", 1200, |h| {
            h["queue_depth"] == 0 && h["train_steps"] == n && h["version"] == n
        });
        assert_eq!(h["train_examples"], n, "{h}");
        let (status, v) = s.post("/v1/completions", &ask);
        assert_eq!(
            (status, v["adapter"].as_str(), v["version"].as_u64()),
            (200, Some("live"), Some(n)),
            "{v}"
        );
        after = v;
        if after["choices"][0]["text"] == target {
            break;
        }
    }
    assert_eq!(
        after["choices"][0]["text"], target,
        "not learned after 60 feedback examples: {after}"
    );
    let version = after["version"].as_u64().unwrap();
    eprintln!("learned after {version} feedback examples (one step each): {after}");
    // nothing trains without feedback: the same version answers the same again
    let again = s.post("/v1/completions", &ask).1;
    assert_eq!(
        (again["version"].as_u64(), &again["choices"][0]["text"]),
        (Some(version), &after["choices"][0]["text"])
    );

    // streamed: server-sent events of the same version that add up to the same text
    let mut r = s
        .agent
        .post(&s.url("/v1/completions"))
        .send_json(json!({ "prompt": prompt, "max_tokens": 8, "stream": true }))
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let body = r.body_mut().read_to_string().unwrap();
    let events: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{body}");
    let mut text = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert_eq!(
            (v["adapter"].as_str(), v["version"].as_u64()),
            (Some("live"), Some(version))
        );
        text.push_str(v["choices"][0]["text"].as_str().unwrap());
    }
    assert_eq!(text, target);

    // the live adapter saved under a name, loaded, served, dropped
    let (status, v) = s.post("/v1/adapters/learned/save", &json!({}));
    assert_eq!(status, 200, "{v}");
    assert!(adapters.join("learned/adapter_model.safetensors").is_file());
    let (status, v) = s.post("/v1/adapters/learned", &json!({}));
    assert_eq!((status, v["version"].as_u64()), (200, Some(1)), "{v}");
    let named = json!({ "prompt": prompt, "max_tokens": 8, "adapter": "learned" });
    let (status, v) = s.post("/v1/completions", &named);
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["adapter"].as_str(), v["version"].as_u64()),
        (Some("learned"), Some(1))
    );
    assert_eq!(v["choices"][0]["text"], target);
    let mut r = s
        .agent
        .delete(&s.url("/v1/adapters/learned"))
        .call()
        .unwrap();
    assert_eq!(
        r.status().as_u16(),
        200,
        "{}",
        r.body_mut().read_to_string().unwrap()
    );
    let mut r = s
        .agent
        .delete(&s.url("/v1/adapters/learned"))
        .call()
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let v: Value = r.body_mut().read_json().unwrap();
    assert!(error_message(404, &v).contains("learned"));

    // bad requests
    let (status, v) = s.post("/v1/completions", &named);
    assert_eq!(status, 404, "{v}");
    assert!(error_message(404, &v).contains("unknown adapter"));
    let (status, v) = s.post(
        "/v1/completions",
        &json!({ "prompt": prompt, "max_tokens": 100000 }),
    );
    assert_eq!(status, 422, "{v}");
    assert!(error_message(422, &v).contains("max_tokens"));
    let (status, v) = s.post(
        "/v1/completions",
        &json!({ "prompt": prompt, "max_tokens": -1 }),
    );
    assert_eq!(status, 422, "{v}");
    assert!(error_message(422, &v).contains("max_tokens"));
    let (status, v) = s.post(
        "/v1/completions",
        &json!({ "prompt": prompt, "temperature": "hot" }),
    );
    assert_eq!(status, 422, "{v}");
    assert!(error_message(422, &v).contains("temperature"));
    let (status, v) = s.post("/v1/adapters/missing", &json!({}));
    assert_eq!(status, 404, "{v}");
    let (status, v) = s.post("/v1/adapters/.hidden", &json!({}));
    assert_eq!(status, 400, "{v}");
    let (status, v) = s.post("/v1/feedback", &json!({ "prompt": prompt }));
    assert_eq!(status, 422, "{v}");
    assert!(error_message(422, &v).contains("completion"));
    let (status, v) = s.get_json("/v1/snapshots/abc");
    assert_eq!(status, 400, "{v}");
    assert!(error_message(400, &v).contains("\"abc\""), "{v}");
    let (status, bytes) = s.get(&format!("/v1/snapshots/{version}"));
    assert_eq!(status, 200);
    assert!(candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu).is_ok());
}

/// The texts of an SSE body's `data:` chunks (the last one `[DONE]`), as JSON.
fn sse_chunks(body: &str) -> Vec<Value> {
    let data: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{body}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[test]
fn openai_routes_answer_concurrent_requests_as_they_answer_one_alone() {
    // no feedback: one version (0) throughout
    let s = Server::start(&[
        "--model",
        "llama",
        "--tiny",
        "--step-tokens",
        "24",
        "--max-running",
        "16",
    ]);
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("Prompt number {i}: {}", "and so on ".repeat(i)))
        .collect();
    let ask = |i: usize| json!({ "prompt": prompts[i], "max_tokens": 3 + 2 * i });
    // each alone first
    let alone: Vec<Value> = (0..8)
        .map(|i| {
            let (status, v) = s.post("/v1/completions", &ask(i));
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["object"], "text_completion");
            assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
            let usage = &v["usage"];
            assert_eq!(usage["completion_tokens"], 3 + 2 * i as u64);
            assert_eq!(
                usage["total_tokens"].as_u64(),
                Some(usage["prompt_tokens"].as_u64().unwrap() + 3 + 2 * i as u64)
            );
            v
        })
        .collect();
    // then 24 at once (three of each): the scheduler batches them; each answer is the same
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..24)
            .map(|k| {
                let (s, ask) = (&s, &ask);
                scope.spawn(move || (k % 8, s.post("/v1/completions", &ask(k % 8))))
            })
            .collect();
        for h in handles {
            let (i, (status, v)) = h.join().unwrap();
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["token_ids"], alone[i]["token_ids"], "prompt {i}");
            assert_eq!(v["choices"][0]["text"], alone[i]["choices"][0]["text"]);
            assert_eq!(v["version"], 0);
        }
    });

    // a stop string: the answer ends before its first occurrence
    let text = alone[7]["choices"][0]["text"].as_str().unwrap().to_string();
    let cut = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[cut..].chars().take(2).collect();
    let (status, v) = s.post(
        "/v1/completions",
        &json!({ "prompt": prompts[7], "max_tokens": 17, "stop": stop }),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["choices"][0]["text"], text[..text.find(&stop).unwrap()]);

    // chat: the model's template, JSON and streamed alike
    let chat = json!({
        "model": "live",
        "messages": [{ "role": "user", "content": "Where is Candleburg?" }],
        "max_tokens": 6,
    });
    let (status, v) = s.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let mut r = s
        .agent
        .post(&s.url("/v1/chat/completions"))
        .send_json(&streamed)
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let chunks = sse_chunks(&r.body_mut().read_to_string().unwrap());
    let joined: String = chunks
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(joined, content);
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );

    let (status, body) = s.get("/metrics");
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    for name in [
        "wick_serve_engine_steps_total",
        "wick_serve_kv_free_blocks",
        "wick_serve_running_sequences 0",
        "wick_serve_waiting_requests 0",
    ] {
        assert!(text.contains(name), "{name} missing from /metrics:\n{text}");
    }
    let (status, models) = s.get_json("/v1/models");
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], "live", "{models}");
    assert_eq!(models["data"][0]["version"], 0);

    // options wick does not implement are refused, naming them
    for (body, what) in [
        (
            json!({ "prompt": "x", "presence_penalty": 1.0 }),
            "presence_penalty",
        ),
        (json!({ "prompt": "x", "n": 2 }), "n:"),
        (json!({ "prompt": "x", "top_p": 0.0 }), "top_p"),
        (json!({ "messages": [] }), "messages"),
        (json!({ "prompt": "x", "model": "nope" }), "unknown adapter"),
    ] {
        let (status, v) = s.post("/v1/completions", &body);
        assert!(status == 422 || status == 404, "{body}: {status} {v}");
        assert!(error_message(status, &v).contains(what), "{body}: {v}");
    }
    let (status, v) = s.post("/v1/chat/completions", &json!({ "prompt": "x" }));
    assert_eq!(status, 422);
    assert!(error_message(422, &v).contains("messages"), "{v}");
}

/// Runs the example with `args` and expects it to refuse them: an exit with a failure status
/// (within 60 s, before it serves) and nothing on stdout. Returns stderr.
fn refused(args: &[&str]) -> String {
    let mut child = Command::new(common::example("serve"))
        .args(args)
        .args(["--host", "127.0.0.1", "--port", "0"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting examples/serve");
    for _ in 0..600 {
        if child.try_wait().expect("wait").is_some() {
            let out = child.wait_with_output().unwrap();
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout).to_string(),
                String::from_utf8_lossy(&out.stderr).to_string(),
            );
            assert!(!out.status.success(), "{args:?} accepted: {stdout}");
            assert!(!stdout.contains("listening"), "{args:?} served: {stdout}");
            return stderr;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("{args:?}: the server started instead of refusing the flags");
}

#[test]
fn flags_out_of_range_are_refused_naming_the_flag() {
    // (flag, value, what the range error says): numbers that would make the server useless
    // (no feedback accepted, no version kept, no request body, no training) and negative ones,
    // which must reach the flag's parser rather than clap's "unexpected argument '-1'"
    let cases = [
        ("--queue-capacity", "0", ">= 1"),
        ("--keep-versions", "0", ">= 1"),
        ("--body-limit", "0", ">= 1"),
        ("--train-share", "0", "(0, 1]"),
        ("--train-share", "1.5", "(0, 1]"),
        ("--train-batch", "0", ">= 1"),
        ("--publish-every", "0", ">= 1"),
        ("--max-batch", "0", ">= 1"),
        ("--max-tokens-limit", "0", ">= 1"),
        ("--hidden", "0", ">= 1"),
        ("--lora-rank", "0", ">= 1"),
        ("--lr", "-1", "> 0"),
        ("--lr", "nan", "finite"),
        ("--train-batch", "-1", ">= 1"),
        ("--checkpoint-every", "-1", ">= 0"),
        ("--queue-capacity", "-5", ">= 1"),
        ("--train-share", "-0.5", "(0, 1]"),
        ("--kv-block-size", "0", ">= 1"),
        ("--kv-blocks", "0", ">= 1"),
        ("--max-running", "0", ">= 1"),
        ("--max-waiting", "-2", ">= 1"),
        ("--step-tokens", "0", ">= 1"),
    ];
    for (flag, value, range) in cases {
        let err = refused(&[flag, value]);
        assert!(
            err.contains(&format!("invalid value '{value}' for '{flag} <")) && err.contains(range),
            "{flag} {value}: {err}"
        );
        assert!(
            !err.contains("unexpected argument") && !err.contains("OnlineConfig"),
            "{flag} {value}: {err}"
        );
    }
    let err = refused(&["--port", "-1"]);
    assert!(
        err.contains("invalid value '-1' for '--port <PORT>'"),
        "{err}"
    );
    // a step must hold every running sequence's decode token
    let err = refused(&[
        "--model",
        "llama",
        "--tiny",
        "--step-tokens",
        "8",
        "--max-running",
        "16",
    ]);
    assert!(
        err.contains("--step-tokens")
            && err.contains("step_tokens (8) must be >= max_running (16)"),
        "{err}"
    );
}

#[test]
fn init_with_a_gguf_says_what_init_takes() {
    let gguf = "data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
    assert!(
        Path::new(env!("CARGO_MANIFEST_DIR")).join(gguf).is_file(),
        "{gguf} (scripts/fetch_smollm2.sh)"
    );
    let err = refused(&["--init", gguf]);
    assert!(
        err.contains("GGUF")
            && err.contains("model.safetensors")
            && err.contains(&format!("--model llama --gguf {gguf}")),
        "{err}"
    );
    assert!(!err.contains("header too large"), "{err}");
    // --model llama reads its weights from --gguf: --init is refused, not ignored
    let err = refused(&["--model", "llama", "--tiny", "--init", gguf]);
    assert!(err.contains("--init") && err.contains("--gguf"), "{err}");
}
