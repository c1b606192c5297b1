//! What a new user of the `mnist` and `char_gpt` examples runs into: flag errors in plain
//! words, `--resume` without a checkpoint, a resumed run that appends to its metrics and warns
//! about a precision change, a small text file of one's own, and `char_gpt`'s ms/step (the
//! same figure in its table and its JSON line) with the step-0 evaluation in metrics.csv.
//! Runs the example binaries that `cargo test` builds (built here when missing).

#![cfg(all(feature = "cli", feature = "plot", feature = "tokenizers"))]

mod common;

use common::{example, text, tmp};
use std::path::Path;
use std::process::{Command, Output};

fn run<S: AsRef<std::ffi::OsStr>>(name: &str, args: &[S]) -> Output {
    Command::new(example(name))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running the example")
}

/// A small MNIST in idx format: `train` and `test` images of 28x28 with labels i % 10.
fn tiny_mnist(dir: &Path, train: u32, test: u32) {
    let write = |name: &str, magic: u32, dims: &[u32], payload: Vec<u8>| {
        let mut b = magic.to_be_bytes().to_vec();
        for d in dims {
            b.extend(d.to_be_bytes());
        }
        b.extend(payload);
        std::fs::write(dir.join(name), b).unwrap();
    };
    for (split, n) in [("train", train), ("t10k", test)] {
        let pixels = (0..n * 784).map(|i| (i * 7 % 251) as u8).collect();
        write(
            &format!("{split}-images-idx3-ubyte"),
            2051,
            &[n, 28, 28],
            pixels,
        );
        let labels = (0..n).map(|i| (i % 10) as u8).collect();
        write(&format!("{split}-labels-idx1-ubyte"), 2049, &[n], labels);
    }
}

/// Runs `program` with `args`, which must be refused while parsing: exit status 2 (clap's
/// usage error), nothing on stdout, and stderr naming the flag as clap writes it
/// (`'--lr <LR>'`) with `range` (the flag's accepted range).
fn refused(program: &Path, args: &[&str], flag: &str, range: &str) {
    let o = Command::new(program)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running the program");
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {out}\n{err}");
    assert!(out.is_empty(), "{args:?}: {out}");
    assert!(
        err.contains(&format!("for '{flag}")) && err.contains(range),
        "{args:?}: wanted {flag} and {range:?} in\n{err}"
    );
    assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
}

#[test]
fn mnist_flag_errors_are_plain() {
    let mnist = example("mnist");
    let mnist = mnist.as_path();
    refused(mnist, &["--epochs", "0"], "--epochs", ">= 1, got 0");
    refused(mnist, &["--epochs", "-1"], "--epochs", ">= 1, got -1");
    refused(mnist, &["--lr", "-1"], "--lr", "> 0, got -1");
    refused(mnist, &["--lr", "0"], "--lr", "> 0, got 0");
    refused(mnist, &["--clip", "-1"], "--clip", "> 0, got -1");
    refused(mnist, &["--batch-size", "0"], "--batch-size", ">= 1");
    refused(mnist, &["--accum", "0"], "--accum", ">= 1");
    refused(mnist, &["--workers", "-2"], "--workers", ">= 0, got -2");
    let o = run("mnist", &["--batch-size", "100", "--accum", "3"]);
    let (_, err) = text(&o);
    assert!(
        err.contains("--batch-size (100) must be a multiple of --accum (3)"),
        "{err}"
    );

    let (help, _) = text(&run("mnist", &["--help"]));
    assert!(help.contains("(0: keep all)"), "{help}");
}

#[test]
fn mnist_resume_needs_a_checkpoint_appends_metrics_and_warns_about_precision() {
    let d = tmp("mnist-resume");
    let data = d.join("data");
    std::fs::create_dir_all(&data).unwrap();
    tiny_mnist(&data, 256, 64);
    let (ck, metrics) = (d.join("ckpt"), d.join("metrics"));
    let common = |extra: &[&str]| {
        let mut a = vec![
            "--data-dir".to_string(),
            data.display().to_string(),
            "--save-dir".into(),
            ck.display().to_string(),
            "--metrics-dir".into(),
            metrics.display().to_string(),
            "--batch-size".into(),
            "64".into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };

    // --resume before any checkpoint exists: an error, not a silent fresh start
    let v = common(&["--resume", "--epochs", "1"]);
    let o = run("mnist", &v);
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(err.contains("nothing to resume: no checkpoint in"), "{err}");

    let v = common(&["--epochs", "1"]);
    let o = run("mnist", &v);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(metrics.join("loss.png").is_file(), "plots after fit");

    let v = common(&["--epochs", "2", "--resume", "--precision", "32"]);
    let o = run("mnist", &v);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.contains("resumed from") && out.contains("at step 4"),
        "{out}"
    );
    // the library's warning (its wording is the checkpoint module's)
    assert!(
        err.contains("saved in bf16-mixed") && err.contains("into 32"),
        "{err}"
    );
    let csv = std::fs::read_to_string(metrics.join("metrics.csv")).unwrap();
    let epochs: Vec<&str> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(1).unwrap())
        .collect();
    assert_eq!(epochs, ["0", "1"], "both epochs' evaluation rows: {csv}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn char_gpt_on_a_tiny_file_of_ones_own_names_the_file_not_the_fetch_script() {
    let d = tmp("gpt-small");
    let f = d.join("mine.txt");
    std::fs::write(&f, b"0123456789").unwrap();
    let o = run("char_gpt", &["--text", f.to_str().unwrap()]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains(&f.display().to_string()) && err.contains("has 10 bytes"),
        "{err}"
    );
    assert!(!err.contains("fetch_shakespeare"), "{err}");
    let o = run(
        "char_gpt",
        &["--text", d.join("missing.txt").to_str().unwrap()],
    );
    let (_, err) = text(&o);
    assert!(
        err.contains("does not exist") && err.contains("--text FILE"),
        "{err}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn char_gpt_flag_errors_name_the_flag_and_its_range() {
    let gpt = example("char_gpt");
    let gpt = gpt.as_path();
    refused(gpt, &["--lr", "-1"], "--lr", "> 0, got -1");
    refused(gpt, &["--steps", "-1"], "--steps", ">= 1, got -1");
    refused(gpt, &["--steps", "0"], "--steps", ">= 1, got 0");
    refused(gpt, &["--clip", "-1"], "--clip", ">= 0, got -1");
    refused(gpt, &["--temperature", "-1"], "--temperature", ">= 0");
    refused(gpt, &["--context", "0"], "--context", ">= 1");
    refused(gpt, &["--batch-size", "0"], "--batch-size", ">= 1");
    refused(gpt, &["--eval-interval", "0"], "--eval-interval", ">= 1");
    refused(gpt, &["--min-lr", "-0.0001"], "--min-lr", ">= 0");
    let o = run("char_gpt", &["--min-lr", "0.1", "--lr", "0.01"]);
    assert!(
        text(&o)
            .1
            .contains("--min-lr (0.1) must be at most --lr (0.01)"),
        "{}",
        text(&o).1
    );
}

/// `wick`'s numeric flags: negative numbers reach the flag's parser, and values that make a
/// benchmark, a launch or a plot useless are refused with the flag's name and range.
#[test]
fn wick_flag_errors_name_the_flag_and_its_range() {
    let wick = Path::new(env!("CARGO_BIN_EXE_wick"));
    refused(
        wick,
        &["bench", "optim", "--iters", "-1"],
        "--iters",
        ">= 1, got -1",
    );
    refused(
        wick,
        &["bench", "optim", "--iters", "0"],
        "--iters",
        ">= 1, got 0",
    );
    refused(wick, &["bench", "step", "--steps", "-1"], "--steps", ">= 1");
    refused(wick, &["bench", "step", "--steps", "0"], "--steps", ">= 1");
    refused(
        wick,
        &["bench", "step", "--warmup", "-1"],
        "--warmup",
        ">= 0",
    );
    refused(wick, &["bench", "step", "--batch", "0"], "--batch", ">= 1");
    refused(
        wick,
        &["launch", "--nproc-per-node", "0", "--", "true"],
        "--nproc-per-node",
        ">= 1",
    );
    refused(
        wick,
        &[
            "launch",
            "--nproc-per-node",
            "1",
            "--grace-s",
            "-1",
            "--",
            "true",
        ],
        "--grace-s",
        ">= 0",
    );
    refused(
        wick,
        &["plot", "m.csv", "--width", "0"],
        "--width",
        "64..=16384",
    );
    let o = Command::new(wick)
        .args(["bench", "optim", "--params", "-5"])
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--params <PARAMS>") && err.contains("got \"-5\""),
        "{err}"
    );
}

/// `wick bench step` on the MLP reports samples/s (not tokens/s) with its basis, in its text
/// and its JSON line, and prints the header's precision and device readably.
#[test]
fn bench_step_mlp_reports_samples_per_s_with_its_basis() {
    let o = Command::new(env!("CARGO_BIN_EXE_wick"))
        .args(["bench", "step", "--model", "mlp", "--device", "cpu"])
        .args([
            "--precision",
            "32",
            "--batch",
            "4",
            "--steps",
            "2",
            "--warmup",
            "1",
        ])
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("precision 32 (fp32) on cpu"), "{out}");
    assert!(!out.contains("Cpu"), "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("samples/s"))
        .unwrap_or_else(|| panic!("no samples/s line in\n{out}"));
    assert!(
        line.contains("trained samples / wall-clock s of steps 2-3; warm-up excluded"),
        "{line}"
    );
    assert!(!out.contains("tokens/s"), "{out}");
    let json: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    // 2 timed steps of 4 samples over 2 x ms_per_step
    let ms = json["mlp_fp32_ms"].as_f64().unwrap();
    let rate = json["mlp_fp32_samples_per_s"].as_f64().unwrap();
    assert!((rate - 4.0 * 1e3 / ms).abs() <= 1e-6 * rate, "{json}");
    assert!(json["samples_per_s_basis"]
        .as_str()
        .is_some_and(|b| b.contains("warm-up excluded")));
    assert!(json.get("mlp_fp32_tok_per_s").is_none(), "{json}");
}

#[test]
fn char_gpt_reports_one_ms_per_step_and_logs_step_zero() {
    let d = tmp("gpt-run");
    let f = d.join("text.txt");
    let body: String = (0..3000)
        .map(|i| (b'a' + (i * 7 % 26) as u8) as char)
        .collect();
    std::fs::write(&f, body).unwrap();
    let m = d.join("metrics");
    let o = run(
        "char_gpt",
        &[
            "--text",
            f.to_str().unwrap(),
            "--layers",
            "1",
            "--d-model",
            "16",
            "--heads",
            "1",
            "--context",
            "8",
            "--batch-size",
            "4",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--eval-interval",
            "2",
            "--eval-batches",
            "1",
            "--log-interval",
            "1",
            "--final-sample",
            "0",
            "--workers",
            "0",
            "--metrics-dir",
            m.to_str().unwrap(),
        ],
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let table_ms: f64 = out
        .lines()
        .filter(|l| l.ends_with("100.0%"))
        .find_map(|l| l.strip_prefix("step "))
        .and_then(|r| r.split_whitespace().next())
        .expect("the table's step row")
        .parse()
        .unwrap();
    let json: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let json_ms = json["phase_ms_per_step"]
        .as_f64()
        .expect("phase_ms_per_step");
    assert!(
        (json_ms - table_ms).abs() <= 0.0005 + 1e-9,
        "table {table_ms} vs JSON {json_ms}"
    );
    // ms_per_step and tokens_per_s share the steps' wall clock: 4 x 8 tokens per step
    let (wall_ms, tokens_per_s) = (json["ms_per_step"].as_f64(), json["tokens_per_s"].as_f64());
    let per_step = wall_ms.unwrap() * tokens_per_s.unwrap() / 1e3;
    assert!((per_step - 32.0).abs() < 1e-6, "{json}");
    assert!(
        json["tokens_per_s_basis"]
            .as_str()
            .is_some_and(|b| b.contains("wall-clock s of steps 1-4")),
        "{json}"
    );
    assert!(
        json["wall_ms_per_step"]
            .as_f64()
            .is_some_and(|w| w >= json_ms),
        "{json}"
    );
    let csv = std::fs::read_to_string(m.join("metrics.csv")).unwrap();
    let first = csv.lines().nth(1).unwrap();
    assert!(
        first.starts_with("0,0,,"),
        "step 0's evaluation row first: {csv}"
    );
    let val0: f64 = first.split(',').nth(3).unwrap().parse().unwrap();
    assert!(
        (val0 - json["val_curve"][0][1].as_f64().unwrap()).abs() < 1e-3,
        "{csv} {json}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// Ctrl-C during training: the example saves a checkpoint and exits with status 130, as
/// other tools do after SIGINT (not 0).
#[cfg(unix)]
#[test]
fn mnist_ctrl_c_saves_and_exits_130() {
    let d = tmp("mnist-sigint");
    let data = d.join("data");
    std::fs::create_dir_all(&data).unwrap();
    tiny_mnist(&data, 512, 64);
    let ck = d.join("ckpt");
    let mut cmd = Command::new(example("mnist"));
    cmd.args([
        "--data-dir",
        data.to_str().unwrap(),
        "--save-dir",
        ck.to_str().unwrap(),
    ])
    .args(["--batch-size", "8", "--epochs", "1000"]);
    // the run header, then the first epoch's line: training is under way
    let (seen, rest, code) = common::interrupt_after(cmd, "epoch 0:");
    assert_eq!(code, Some(130), "{seen:?} {rest:?}");
    assert!(
        rest.iter().any(|l| l.starts_with("interrupted: saved")),
        "{rest:?}"
    );
    assert!(wick::checkpoint::latest(&ck).unwrap().is_some());
    std::fs::remove_dir_all(&d).unwrap();
}

/// finetune_bert on a CPU-sized sample of the real data (scripts/fetch_minilm.sh and
/// scripts/fetch_shakespeare.sh, which `.ci/run` calls): the baselines, before/after scores,
/// the exported batches (what scripts/torch_bert_genre.py reads) and a saved encoder that
/// loads back.
#[test]
fn finetune_bert_trains_exports_and_saves_on_a_cpu_sample() {
    let dir = tmp("bert");
    let (batches, saved) = (dir.join("batches.json"), dir.join("saved"));
    let o = run(
        "finetune_bert",
        &[
            "--max-train",
            "192",
            "--max-test",
            "96",
            "--batch-size",
            "32",
            "--precision",
            "fp32",
            "--timing-warmup",
            "2",
            "--export-batches",
            batches.to_str().unwrap(),
            "--save",
            saved.to_str().unwrap(),
        ],
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    for want in [
        "majority (histories)",
        "bag-of-bytes",
        "before fine-tuning",
        "wick fine-tuned",
        "RESULT {",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&batches).unwrap()).unwrap();
    let train = json["train"].as_array().unwrap();
    assert_eq!(train.len(), 6, "192 lines in batches of 32");
    let rows: usize = train
        .iter()
        .map(|b| b["labels"].as_array().unwrap().len())
        .sum();
    assert_eq!(rows, 192);
    for b in train {
        let ids = b["ids"].as_array().unwrap();
        let width = ids[0].as_array().unwrap().len();
        assert_eq!(width % 8, 0, "padded to a multiple of 8");
        let longest = b["lengths"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_u64().unwrap())
            .max()
            .unwrap();
        assert!(width as u64 >= longest && (width as u64) < longest + 8);
    }
    assert_eq!(json["config"]["total_steps"], 6);
    for f in [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "head.safetensors",
    ] {
        assert!(saved.join(f).exists(), "{f} not saved");
    }
    let head =
        candle_core::safetensors::load(saved.join("head.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    assert_eq!(head["head.weight"].dims(), &[6, 384]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Fake plays for `--plays`: three genres of 6, 7 and 8 plays whose plays have 2 to 9 lines,
/// so that the folds' test sets differ in size. Returns the folder and the number of lines.
fn fake_plays(dir: &Path) -> usize {
    let mut lines = 0;
    for (genre, plays) in [("comic", 6), ("royal", 7), ("tragic", 8)] {
        std::fs::create_dir_all(dir.join(genre)).unwrap();
        for p in 0..plays {
            let mut md = format!("# {genre} {p}\n\n**SPEAKER**  \n");
            for l in 0..2 + (p * 3 + genre.len()) % 8 {
                md.push_str(&format!("the {genre} line {l} of play {p} goes here  \n"));
                lines += 1;
            }
            std::fs::write(dir.join(genre).join(format!("play{p}.md")), md).unwrap();
        }
    }
    lines
}

/// finetune_bert --cv on fake plays (the real tokenizer and weights): five folds, each play a
/// test play once, and pooled accuracies equal to the line-weighted means of the folds'.
#[test]
fn finetune_bert_cross_validates_by_play() {
    let dir = tmp("bert-cv");
    let total_lines = fake_plays(&dir);
    let o = run(
        "finetune_bert",
        &[
            "--cv",
            "--plays",
            dir.to_str().unwrap(),
            "--max-train",
            "48",
            "--batch-size",
            "16",
            "--precision",
            "fp32",
            "--timing-warmup",
            "0",
        ],
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    for k in 0..5 {
        assert!(
            out.contains(&format!("=== fold {k} ")),
            "no fold {k} in\n{out}"
        );
        let rows = out
            .lines()
            .filter(|l| l.starts_with(&format!("fold {k} ")))
            .count();
        assert_eq!(rows, 1, "fold {k} in the table\n{out}");
    }
    for want in [
        "pooled over 5 folds",
        "wick fine-tuned (pooled)",
        "majority (pooled)",
        "bag-of-bytes (pooled)",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    let r: serde_json::Value = serde_json::from_str(
        out.lines()
            .find_map(|l| l.strip_prefix("RESULT "))
            .expect("RESULT line"),
    )
    .unwrap();
    assert_eq!(r["mode"], "cv");
    let folds = r["per_fold"].as_array().unwrap();
    assert_eq!(folds.len(), 5);
    // every play is a test play exactly once
    let mut plays: Vec<&str> = folds
        .iter()
        .flat_map(|f| f["test_plays"].as_array().unwrap())
        .map(|p| p.as_str().unwrap())
        .collect();
    plays.sort();
    let n = plays.len();
    plays.dedup();
    assert_eq!((n, plays.len()), (21, 21), "{plays:?}");
    // pooled = line-weighted mean of the folds, recomputed here; every line scored once
    let lines: Vec<f64> = folds
        .iter()
        .map(|f| f["test_lines"].as_f64().unwrap())
        .collect();
    assert_eq!(lines.iter().sum::<f64>() as usize, total_lines);
    assert_eq!(r["pooled"]["test_lines"], total_lines);
    assert!(
        lines.iter().any(|&l| l != lines[0]),
        "the folds should differ in size: {lines:?}"
    );
    for method in ["wick", "majority", "bag_of_bytes"] {
        let weighted: f64 = folds
            .iter()
            .zip(&lines)
            .map(|(f, n)| f[method]["accuracy"].as_f64().unwrap() * n)
            .sum::<f64>()
            / lines.iter().sum::<f64>();
        let pooled = r["pooled"][method]["accuracy"].as_f64().unwrap();
        assert!(
            (pooled - weighted).abs() < 1e-9,
            "{method}: pooled {pooled} vs weighted mean {weighted}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn finetune_bert_flag_errors_are_plain() {
    let o = run("finetune_bert", &["--model-dir", "/nonexistent"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("--model-dir /nonexistent: no such folder")
            && err.contains("scripts/fetch_minilm.sh"),
        "{err}"
    );
    // a folder without the model's files names the missing ones
    let d = tmp("bert-empty-model");
    std::fs::write(d.join("config.json"), "{}").unwrap();
    let o = run("finetune_bert", &["--model-dir", d.to_str().unwrap()]);
    let (_, err) = text(&o);
    assert!(
        err.contains("the folder has no tokenizer.json, model.safetensors")
            && err.contains("scripts/fetch_minilm.sh"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
    let bert = example("finetune_bert");
    let bert = bert.as_path();
    refused(bert, &["--lr", "0"], "--lr", "> 0, got 0");
    refused(bert, &["--head-lr", "-1"], "--head-lr", "> 0, got -1");
    refused(bert, &["--epochs", "-1"], "--epochs", ">= 1, got -1");
    refused(bert, &["--batch-size", "0"], "--batch-size", ">= 1");
    refused(bert, &["--warmup-frac", "1"], "--warmup-frac", "[0, 1)");
    refused(bert, &["--max-train", "0"], "--max-train", ">= 1");
    refused(bert, &["--clip", "-1"], "--clip", "> 0");
    // --cv refuses the single-split flags before any work (nothing on stdout)
    let o = run("finetune_bert", &["--cv", "--save", "x"]);
    let (out, err) = text(&o);
    assert!(!o.status.success());
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("--cv cannot be used with --save") && err.contains("--test-fold K"),
        "{err}"
    );
    assert!(!Path::new("x").exists());
    let o = run("finetune_bert", &["--test-fold", "5"]);
    assert!(text(&o)
        .1
        .contains("--test-fold 5 is out of range: the folds are 0 to 4"));
}

/// finetune on the CPU (scripts/fetch_smollm2.sh and scripts/fetch_shakespeare.sh,
/// which `.ci/run` calls): a tiny random model with full fine-tuning and checkpointing, then
/// two LoRA steps of the real SmolLM2-135M whose adapters and merged weights load back.
#[test]
fn finetune_llama_runs_tiny_full_and_real_lora_on_the_cpu() {
    let o = run(
        "finetune",
        &[
            "--tiny",
            "--full",
            "--checkpointing",
            "--steps",
            "6",
            "--warmup-steps",
            "1",
            "--context",
            "32",
            "--batch",
            "2",
            "--val-batches",
            "2",
            "--max-new-tokens",
            "4",
            "--lr",
            "1e-3",
            "--precision",
            "fp32",
        ],
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let result: serde_json::Value = serde_json::from_str(
        out.lines()
            .find_map(|l| l.strip_prefix("RESULT "))
            .expect("RESULT line"),
    )
    .unwrap();
    assert_eq!(result["mode"], "full");
    assert_eq!(result["frozen_bytes"], 0);
    let (before, after) = (
        result["val_loss_before"].as_f64().unwrap(),
        result["val_loss_after"].as_f64().unwrap(),
    );
    // a random model over 49152 tokens starts near ln(49152) = 10.8 and learns the unigram
    assert!(
        (before - 10.8).abs() < 0.3 && after < before,
        "{before} -> {after}"
    );

    let dir = tmp("llama");
    let (adapters, merged) = (dir.join("adapters"), dir.join("merged"));
    let o = run(
        "finetune",
        &[
            "--lora",
            "4",
            "--steps",
            "2",
            "--warmup-steps",
            "0",
            "--context",
            "48",
            "--batch",
            "1",
            "--val-batches",
            "1",
            "--max-new-tokens",
            "3",
            "--save",
            adapters.to_str().unwrap(),
            "--save-merged",
            merged.to_str().unwrap(),
        ],
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    for want in [
        "SmolLM2-135M-Instruct (llama), LoRA r4",
        "validation loss at step 0",
        "greedy at step 0",
        "greedy after",
        "tokens/s (trained tokens / wall-clock s of steps 1-2; warm-up and checkpoint saves excluded)",
    ] {
        assert!(out.contains(want), "{want:?} missing from\n{out}");
    }
    assert!(adapters.join("tokenizer.json").is_file());
    assert!(merged.join("tokenizer_config.json").is_file());
    let (cfg, tensors) = wick::lora::load_adapters(&adapters).unwrap();
    assert_eq!(cfg.r, 4);
    assert_eq!(tensors.len(), 30 * 7 * 2);
    let back = wick::models::files::read_safetensors(&merged).unwrap();
    assert_eq!(back.config.num_hidden_layers, 30);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn finetune_llama_flag_errors_are_plain() {
    let o = run("finetune", &["--gguf", "/nonexistent.gguf"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("/nonexistent.gguf") && err.contains("fetch_smollm2.sh"),
        "{err}"
    );
    let o = run("finetune", &["--full", "--lora", "8"]);
    assert!(!o.status.success());
    let o = run("finetune", &["--tiny", "--lora", "0"]);
    let err = text(&o).1;
    assert!(
        err.contains("'--lora <LORA>': must be a whole number >= 1"),
        "{err}"
    );
}
