//! `wick finetune --config run.toml` as a user meets it: a misspelt key, a bad value, a missing
//! model or data file are errors naming the key or the file, before anything trains; a tiny run
//! writes metrics.csv, the plots, checkpoints, the PEFT adapter and the merged HF folder, with a
//! finite and falling evaluation loss; a run resumed from its checkpoint writes the same metrics
//! rows, bit for bit, as the uninterrupted run; a resume with another config is refused naming
//! the key; the saved adapter loads back and, on the same base, gives the merged folder's
//! logits. Padded batches (packing off) train too. Needs scripts/fetch_smollm2.sh (the tokenizer
//! and chat template of the tiny model) and the `wick` binary `cargo test` builds.

#![cfg(all(feature = "cli", feature = "plot", feature = "tokenizers"))]

mod common;

use common::{result, text, tmp};
use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};
use wick::candle_core::{DType, Device, Tensor};
use wick::finetune::model::{ModelSpec, Weights};
use wick::models::{Decoder, FineTune, KvCache, Source};
use wick::{ParamStore, Precision};

const GGUF: &str = "data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn wick(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_wick"))
        .args(args)
        .current_dir(root())
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("running wick")
}

/// `wick finetune --config FILE` with `toml` written to `dir/run.toml`.
fn finetune(dir: &Path, toml: &str, extra: &[&str]) -> Output {
    let path = dir.join("run.toml");
    std::fs::write(&path, toml).unwrap();
    let mut args = vec!["finetune", "--config", path.to_str().unwrap()];
    args.extend_from_slice(extra);
    wick(&args)
}

/// `n` short conversations (a question and the assistant's answer) as JSONL in `path`.
fn conversations(path: &Path, n: usize) {
    let mut s = String::new();
    for i in 0..n {
        let (a, b) = (i % 7, i % 5);
        let line = serde_json::json!({ "messages": [
            { "role": "user", "content": format!("What is {a} plus {b}?") },
            { "role": "assistant", "content": format!("{a} plus {b} is {}.", a + b) },
        ]});
        s.push_str(&format!("{line}\n"));
    }
    std::fs::write(path, s).unwrap();
}

/// A tiny LoRA run on `train`; `more` (the `[save]` table) is appended.
fn config(train: &Path, more: &str) -> String {
    format!(
        r#"
[model]
gguf = "{gguf}"
tiny = true

[data]
train = ["{train}"]
eval_fraction = 0.25
max_length = 96

[batch]
tokens_per_batch = 256

[tuning]
method = "lora"
r = 4
alpha = 8
target_modules = ["q_proj", "v_proj", "down_proj"]
precision = "f32"

[schedule]
learning_rate = 5e-3
warmup_steps = 1
max_steps = 6
seed = 3

[eval]
every_steps = 3
at_start = true

[log]
every_steps = 1
progress = false
{more}
"#,
        gguf = root().join(GGUF).display(),
        train = train.display(),
    )
}

fn save_table(dir: &Path) -> String {
    format!(
        "[save]\ndir = \"{}\"\nevery_steps = 3\nkeep_last = 0\nmerged = true\n",
        dir.display()
    )
}

/// The metrics rows without the throughput columns (wall-clock rates).
fn rows(csv: &Path) -> Vec<String> {
    std::fs::read_to_string(csv)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').take(7).collect::<Vec<_>>().join(","))
        .collect()
}

#[test]
fn bad_configs_name_the_key_or_the_file() {
    let d = tmp("finetune-cmd-errors");
    let train = d.join("train.jsonl");
    conversations(&train, 8);
    let good = config(&train, &save_table(&d.join("out")));
    for (toml, want) in [
        (
            good.replace("r = 4", "rank = 4"),
            vec!["unknown field `rank`", "run.toml", "line"],
        ),
        (
            good.replace("r = 4", "r = 0"),
            vec!["tuning.r must be >= 1"],
        ),
        (
            good.replace("max_steps = 6", "max_steps = 6\nepochs = 2"),
            vec!["both epochs and max_steps"],
        ),
        (
            good.replace("[data]\n", "[data]\nshakespeare = \"x\"\n"),
            vec!["both train and shakespeare"],
        ),
        (
            good.replace("method = \"lora\"", "method = \"qlora\""),
            vec!["unknown variant `qlora`", "lora", "full"],
        ),
        (
            good.replace("tokens_per_batch = 256", "tokens_per_batch = 64"),
            vec!["batch.tokens_per_batch (64) must be >= data.max_length (96)"],
        ),
        (good.replace("[model]\n", ""), vec!["unknown field `gguf`"]),
        (
            good.replace(&*train.display().to_string(), "/nonexistent/chats.jsonl"),
            vec!["data.train", "/nonexistent/chats.jsonl"],
        ),
        (
            good.replace(
                &*root().join(GGUF).display().to_string(),
                "/nonexistent.gguf",
            ),
            vec!["/nonexistent.gguf"],
        ),
        (
            good.replace("max_length = 96", "max_length = 100000")
                .replace("tokens_per_batch = 256", "tokens_per_batch = 100000"),
            vec!["data.max_length 100000 exceeds the model's 512 positions"],
        ),
    ] {
        let o = finetune(&d, &toml, &[]);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{want:?}:\n{out}\n{err}");
        for w in &want {
            assert!(err.contains(w), "{w:?} missing from\n{err}");
        }
        assert!(!out.contains("RESULT"), "{out}");
    }
    // a --device override is checked as the file's key is, before anything loads
    let o = finetune(&d, &good, &["--device", "gpu"]);
    let err = text(&o).1;
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--device") && err.contains("device must be \"cpu\" or \"cuda\""),
        "{err}"
    );
    // a malformed line names the file and the line
    std::fs::write(&train, "{\"messages\": []}\n").unwrap();
    let err = text(&finetune(&d, &good, &[])).1;
    assert!(
        err.contains(&format!("{}:1", train.display())) && err.contains("empty"),
        "{err}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// A tiny LoRA run of 6 steps (checkpoints at 3 and 6), then the same config resumed from a
/// copy of its step-3 checkpoint: steps 4-6 give the same metrics rows to the last bit. The run
/// writes the plots, the adapter and the merged folder; the adapter loaded back onto the same
/// tiny base gives the merged model's logits.
#[test]
fn tiny_run_saves_everything_and_resumes_bit_for_bit() {
    let d = tmp("finetune-cmd-run");
    let train = d.join("train.jsonl");
    conversations(&train, 64);
    let (a, b) = (d.join("a"), d.join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let whole = result(&finetune(&a, &config(&train, &save_table(&a)), &[]));
    assert_eq!(whole["steps"], 6);
    for f in [
        "metrics.csv",
        "metrics.jsonl",
        "loss.png",
        "phases.png",
        "phases.csv",
        "checkpoints/step-000003/model.safetensors",
        "checkpoints/step-000006/trainer_state.json",
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
        "adapter/tokenizer.json",
        "merged/model.safetensors",
        "merged/config.json",
        "merged/tokenizer_config.json",
    ] {
        assert!(a.join(f).is_file(), "{f} missing");
    }
    let evals: Vec<f64> = whole["eval_losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[1].as_f64().unwrap())
        .collect();
    assert_eq!(evals.len(), 3, "{evals:?}");
    assert!(
        evals.iter().all(|e| e.is_finite()) && evals[2] < evals[0],
        "{evals:?}"
    );
    let a_rows = rows(&a.join("metrics.csv"));
    // step 0 (evaluation), steps 1-6
    assert_eq!(a_rows.len(), 7, "{a_rows:?}");

    // the same config in another folder, resumed from a copy of the step-3 checkpoint
    let ck = b.join("checkpoints/step-000003");
    std::fs::create_dir_all(&ck).unwrap();
    for f in std::fs::read_dir(a.join("checkpoints/step-000003")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, ck.join(f.file_name().unwrap())).unwrap();
    }
    let b_config = config(&train, &save_table(&b));
    let o = finetune(&b, &b_config, &["--resume"]);
    let resumed = result(&o);
    assert!(
        text(&o).0.contains("resumed from") && resumed["resumed_at"] == 3,
        "{resumed}"
    );
    assert_eq!(rows(&b.join("metrics.csv")), a_rows[4..]);
    assert_eq!(resumed["eval_losses"][0], whole["eval_losses"][2]);

    // another seed is another run; a run at its end has nothing to resume
    let other = b_config.replace("seed = 3", "seed = 4");
    let err = text(&finetune(&b, &other, &["--resume"])).1;
    assert!(
        err.contains("made by a different run") && err.contains("schedule.seed 3 (this run: 4)"),
        "{err}"
    );
    let err = text(&finetune(&b, &b_config, &["--resume"])).1;
    assert!(
        err.contains("is at step 6") && err.contains("raise schedule.max_steps"),
        "{err}"
    );

    // the adapter, loaded back onto the same tiny base, gives the merged model's logits
    let (cfg, tensors) = wick::lora::load_adapters(&a.join("adapter")).unwrap();
    assert_eq!((cfg.r, cfg.alpha), (4, 8.0));
    let spec = ModelSpec {
        source: Source::Gguf(root().join(GGUF)),
        weights: Weights::Tiny,
    };
    let shape = spec.shape().unwrap();
    let base = spec.weights(&shape, 3).unwrap();
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let adapted = Decoder::new(&store, &base, &FineTune::Lora(cfg))
        .unwrap()
        .with_adapters(&tensors.into_iter().collect::<HashMap<_, _>>())
        .unwrap();
    let merged_weights = wick::models::files::read_safetensors(&a.join("merged")).unwrap();
    let merged = Decoder::new(
        &ParamStore::new(Precision::Fp32, Device::Cpu, 0),
        &merged_weights,
        &FineTune::Full,
    )
    .unwrap();
    let ids = Tensor::new(&[[1u32, 17, 300, 4000, 25, 9]], &Device::Cpu).unwrap();
    let logits = |m: &Decoder| {
        m.forward_cached(&ids, &mut KvCache::default())
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let (x, y) = (logits(&adapted), logits(&merged));
    let diff = common::max_abs(&x, &y);
    assert!(diff < 1e-4, "adapter vs merged logits differ by {diff}");
    // and the adapter changed the model: the untrained base's logits differ
    let untrained = Decoder::new(
        &ParamStore::new(Precision::Fp32, Device::Cpu, 0),
        &base,
        &FineTune::Full,
    )
    .unwrap();
    assert!(common::max_abs(&logits(&untrained), &y) > 1e-3);
    std::fs::remove_dir_all(&d).unwrap();
}

/// Padded batches (`packing = false`) and a full fine-tune with accumulation train too, and save
/// the model as an HF folder (no adapter).
#[test]
fn padded_full_run_with_accumulation() {
    let d = tmp("finetune-cmd-padded");
    let train = d.join("train.jsonl");
    conversations(&train, 24);
    let toml = config(&train, &format!("[save]\ndir = \"{}\"\n", d.display()))
        .replace("tokens_per_batch = 256", "packing = false\nbatch_size = 4\naccumulation_steps = 2")
        .replace(
            "method = \"lora\"\nr = 4\nalpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\", \"down_proj\"]",
            "method = \"full\"",
        )
        .replace("max_steps = 6", "epochs = 2");
    let r = result(&finetune(&d, &toml, &[]));
    // 18 training examples: 5 batches of <= 4, 3 steps of <= 2 batches, 2 epochs
    assert_eq!(
        (r["train_examples"].as_u64(), r["steps"].as_u64()),
        (Some(18), Some(6))
    );
    assert!(r["adapter"].is_null());
    assert!(d.join("merged/model.safetensors").is_file());
    assert!(!d.join("adapter").exists());
    let last = r["eval_losses"].as_array().unwrap().last().unwrap()[1]
        .as_f64()
        .unwrap();
    assert!(last.is_finite(), "{r}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Ctrl-C during training saves a checkpoint (of step 1 or later) and exits with status 130.
#[cfg(unix)]
#[test]
fn ctrl_c_saves_a_checkpoint_and_exits_130() {
    let d = tmp("finetune-cmd-sigint");
    let train = d.join("train.jsonl");
    conversations(&train, 32);
    let toml = config(&train, &save_table(&d)).replace("max_steps = 6", "max_steps = 100000");
    let path = d.join("run.toml");
    std::fs::write(&path, &toml).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wick"));
    cmd.args(["finetune", "--config", path.to_str().unwrap()])
        .current_dir(root());
    let (seen, rest, code) = common::interrupt_after(cmd, "step ");
    assert_eq!(code, Some(130), "{seen:?} {rest:?}");
    assert!(
        rest.iter().any(|l| l.starts_with("interrupted: saved")),
        "{rest:?}"
    );
    let saved = wick::checkpoint::latest(d.join("checkpoints"))
        .unwrap()
        .expect("a checkpoint");
    let step = wick::checkpoint::read_state(&saved).unwrap().step;
    assert!(step >= 1, "{step}");
    std::fs::remove_dir_all(&d).unwrap();
}
