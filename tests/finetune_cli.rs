//! `finetune` as a new user meets it: flag errors that name the flag and its range, a
//! `--context` beyond the model's positions refused, periodic checkpoints and `--resume` that
//! continue a run bit for bit, Ctrl-C saving a checkpoint (exit 130), HF folders that carry
//! the tokenizer (`tokenizer.json` loads back with the `tokenizers` crate and gives
//! transformers' ids), and a tokenization of only the text a run needs that equals the whole
//! text's. Needs scripts/fetch_smollm2.sh and scripts/fetch_shakespeare.sh (as `.ci/run` does)
//! and the example binary that `cargo test` builds.

#![cfg(all(feature = "cli", feature = "plot", feature = "tokenizers"))]

mod common;

use common::{example, result, text, tmp};
use std::path::Path;
use std::process::{Command, Output};
use wick::models::files::Gguf;
use wick::models::tokenizer::{safe_cut, TextTokenizer};

const GGUF: &str = "data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const TEXT: &str = "data/shakespeare/input.txt";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn run<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(example("finetune"))
        .args(args)
        .current_dir(root())
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("running finetune")
}

/// Items `range` of the JSON array `v`.
fn slice(v: &serde_json::Value, range: std::ops::Range<usize>) -> serde_json::Value {
    v.as_array().unwrap()[range].to_vec().into()
}

/// A tiny full fine-tune of `steps` timed steps and no warm-up, logging every step.
fn tiny_args(steps: usize, ckpt: &Path) -> Vec<String> {
    let mut v: Vec<String> = [
        "--tiny",
        "--full",
        "--warmup-steps",
        "0",
        "--context",
        "32",
        "--batch",
        "2",
        "--val-batches",
        "2",
        "--max-new-tokens",
        "2",
        "--lr",
        "1e-3",
        "--log-every",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend([
        "--steps".into(),
        steps.to_string(),
        "--checkpoint-dir".into(),
        ckpt.display().to_string(),
    ]);
    v
}

/// Flag errors name the flag and its range: clap's (exit 2) before anything runs, the checks
/// that need the model (exit 1) before training.
#[test]
fn flag_errors_name_the_flag_and_its_range() {
    for (args, code, want) in [
        (
            &["--lr", "-1"][..],
            2,
            "'--lr <LR>': must be a finite number > 0",
        ),
        (
            &["--clip", "-1"],
            2,
            "'--clip <CLIP>': must be a finite number >= 0",
        ),
        (
            &["--steps", "-1"],
            2,
            "'--steps <STEPS>': must be a whole number >= 1",
        ),
        (
            &["--steps", "0"],
            2,
            "'--steps <STEPS>': must be a whole number >= 1",
        ),
        (
            &["--batch", "0"],
            2,
            "'--batch <BATCH>': must be a whole number >= 1",
        ),
        (
            &["--lora", "0"],
            2,
            "'--lora <LORA>': must be a whole number >= 1",
        ),
        (
            &["--lora-dropout", "1"],
            2,
            "'--lora-dropout <LORA_DROPOUT>': must be in [0, 1)",
        ),
        (
            &["--weight-decay", "-0.1"],
            2,
            "'--weight-decay <WEIGHT_DECAY>': must be a finite number >= 0",
        ),
        (
            &["--precision", "fp64"],
            2,
            "'--precision <PRECISION>': unknown precision \"fp64\"",
        ),
        (
            &["--tiny", "--context", "100000"],
            1,
            "--context 100000 exceeds the 512 positions of the --tiny model",
        ),
        // SmolLM2's llama.context_length is 8192
        (
            &["--context", "8193"],
            1,
            "--context 8193 exceeds the 8192 positions of",
        ),
        (&["--tiny", "--context", "1"], 1, "--context 1 is too short"),
        (
            &["--gguf", "/nonexistent.gguf"],
            1,
            "run scripts/fetch_smollm2.sh",
        ),
    ] {
        let o = run(args);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(code), "{args:?}:\n{out}\n{err}");
        assert!(err.contains(want), "{args:?}: {want:?} missing from\n{err}");
        assert!(!out.contains("tokens/s"), "{args:?} trained:\n{out}");
    }
}

/// 3 steps with a checkpoint at step 3, then `--resume` to step 6: the resumed run starts at
/// step 3 and its losses and final validation loss equal those of 6 uninterrupted steps bit
/// for bit. A resume with other flags, past the end, or without a checkpoint is refused.
#[test]
fn tiny_run_resumes_from_its_checkpoint_exactly() {
    let d = tmp("finetune-resume");
    let (ck, ck_whole) = (d.join("ck"), d.join("ck-whole"));
    let whole = result(&run(&tiny_args(6, &ck_whole)));
    assert!(wick::checkpoint::latest(&ck_whole).unwrap().is_none());

    let mut first = tiny_args(3, &ck);
    first.extend(["--save-every".into(), "3".into()]);
    let first = result(&run(&first));
    assert_eq!(first["train_losses"], slice(&whole["train_losses"], 0..3));
    let latest = wick::checkpoint::latest(&ck)
        .unwrap()
        .expect("a checkpoint");
    assert!(latest.ends_with("step-000003"), "{}", latest.display());

    let mut resume = tiny_args(6, &ck);
    resume.push("--resume".into());
    let o = run(&resume);
    let out = text(&o).0;
    assert!(
        out.contains("resumed from") && out.contains("at step 3"),
        "{out}"
    );
    let resumed = result(&o);
    assert_eq!(resumed["resumed_at"], 3);
    // steps 4, 5, 6 as in the uninterrupted run, to the last bit
    assert_eq!(resumed["train_losses"], slice(&whole["train_losses"], 3..6));
    assert_eq!(resumed["val_loss_after"], whole["val_loss_after"]);
    assert_ne!(whole["val_loss_after"], whole["val_loss_before"]);

    let mut other = resume.clone();
    other.extend(["--seed".into(), "5".into()]);
    let err = text(&run(&other)).1;
    assert!(
        err.contains("made by a different run") && err.contains("seed 0 (this run: 5)"),
        "{err}"
    );
    // another mode is refused by its flags before the model is built, not by the parameters
    let lora: Vec<String> = resume
        .iter()
        .map(|s| s.replace("--full", "--lora=4"))
        .collect();
    let (out, err) = text(&run(&lora));
    assert!(
        err.contains("made by a different run")
            && err.contains(r#"mode "full" (this run: "lora4")"#),
        "{err}"
    );
    assert!(!out.contains("trainable parameters"), "{out}");
    let mut done = tiny_args(3, &ck);
    done.push("--resume".into());
    let err = text(&run(&done)).1;
    assert!(
        err.contains("is at step 3") && err.contains("raise --steps"),
        "{err}"
    );
    let mut none = tiny_args(6, &d.join("empty"));
    none.push("--resume".into());
    let err = text(&run(&none)).1;
    assert!(err.contains("nothing to resume: no checkpoint in"), "{err}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Runs finetune with `args`, sends it SIGINT once a stdout line starts with `after`,
/// and returns the lines before and after that one (included in the first) and the exit status.
#[cfg(unix)]
fn interrupt_after(args: &[String], after: &str) -> (Vec<String>, Vec<String>, Option<i32>) {
    let mut cmd = Command::new(example("finetune"));
    cmd.args(args).current_dir(root());
    common::interrupt_after(cmd, after)
}

#[cfg(unix)]
#[test]
fn ctrl_c_saves_a_checkpoint_and_exits_130() {
    let d = tmp("finetune-sigint");
    let ck = d.join("ck");
    let (seen, rest, code) = interrupt_after(&tiny_args(100_000, &ck), "step ");
    assert_eq!(code, Some(130), "{seen:?} {rest:?}");
    assert!(
        rest.iter().any(|l| l.starts_with("interrupted: saved")),
        "{rest:?}"
    );
    let saved = wick::checkpoint::latest(&ck)
        .unwrap()
        .expect("a checkpoint");
    let step = wick::checkpoint::read_state(&saved).unwrap().step;
    assert!(step >= 1, "{step}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Ctrl-C after the last step (here during the final validation of 40 batches) is not
/// swallowed: the trained state is saved as a checkpoint at the last step and the run exits
/// with 130 instead of finishing.
#[cfg(unix)]
#[test]
fn ctrl_c_after_training_saves_and_exits_130() {
    let d = tmp("finetune-sigint-final");
    let ck = d.join("ck");
    let mut args = tiny_args(1, &ck);
    let v = args.iter().position(|s| s == "--val-batches").unwrap();
    args[v + 1] = "40".into();
    let (seen, rest, code) = interrupt_after(&args, "step    1/1");
    assert_eq!(code, Some(130), "{seen:?} {rest:?}");
    assert!(rest.iter().all(|l| !l.starts_with("RESULT")), "{rest:?}");
    assert!(
        rest.iter().any(|l| l.starts_with("interrupted")),
        "{rest:?}"
    );
    let saved = wick::checkpoint::latest(&ck)
        .unwrap()
        .expect("a checkpoint");
    assert_eq!(wick::checkpoint::read_state(&saved).unwrap().step, 1);
    std::fs::remove_dir_all(&d).unwrap();
}

/// A resumed run draws its windows from the checkpointing run's tokens even when its larger
/// `--steps` would tokenize more: 1 step (one 64 KB piece of text) resumed with `--steps 400`
/// (400 x 2 x 33 tokens: more than that piece) keeps the first run's token count, and its
/// step 2 has the loss of an uninterrupted 2-step run.
#[cfg(unix)]
#[test]
fn resume_with_more_steps_keeps_the_runs_tokens() {
    let d = tmp("finetune-resume-tokens");
    let ck = d.join("ck");
    let two = result(&run(&tiny_args(2, &d.join("ck-two"))));
    let small = two["train_tokens"].as_u64().unwrap() as usize;
    // a fresh --steps 400 run tokenizes more (the case this test is about)
    let tok = TextTokenizer::from_gguf(&Gguf::open(&root().join(GGUF)).unwrap()).unwrap();
    let text = std::fs::read_to_string(root().join(TEXT)).unwrap();
    let cut = safe_cut(&text, text.len() * 9 / 10);
    let big = tok
        .encode_prefix(&text[..cut], 400 * 2 * 33)
        .unwrap()
        .0
        .len();
    assert!(
        big > small,
        "{big} <= {small}: no larger tokenization to test"
    );

    let mut first = tiny_args(1, &ck);
    first.extend(["--save-every".into(), "1".into()]);
    assert_eq!(result(&run(&first))["train_tokens"], small);
    let mut resume = tiny_args(400, &ck);
    resume.push("--resume".into());
    let (seen, rest, code) = interrupt_after(&resume, "step    2/400");
    assert_eq!(code, Some(130), "{seen:?} {rest:?}");
    let header = format!("train: {small} tokens of");
    assert!(
        seen.iter().any(|l| l.contains(&header)),
        "{header}: {seen:?}"
    );
    let want = format!(
        "loss {:.4} ",
        two["train_losses"][1][1].as_f64().unwrap() as f32
    );
    let step2 = seen.last().unwrap();
    assert!(step2.contains(&want), "{want:?} in {step2:?}");
    let saved = wick::checkpoint::latest(&ck).unwrap().unwrap();
    let state = wick::checkpoint::read_state(&saved).unwrap();
    assert!(state.step >= 2, "{}", state.step);
    assert_eq!(state.extra["train_tokens"], small);
    std::fs::remove_dir_all(&d).unwrap();
}

/// The merged HF folder of a tiny run carries the tokenizer: `tokenizer.json` loaded back with
/// the `tokenizers` crate gives transformers' ids on the fixture texts (made by
/// scripts/smollm2_fixture.py with transformers' GGUF tokenizer), and `tokenizer_config.json`
/// names the GGUF's special tokens and chat template.
#[test]
fn merged_folder_carries_a_tokenizer_transformers_reads() {
    let d = tmp("finetune-merged");
    let merged = d.join("merged");
    let mut args = tiny_args(1, &d.join("ck"));
    args.extend(["--save-merged".into(), merged.display().to_string()]);
    result(&run(&args));
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(merged.join(f).is_file(), "{f} missing");
    }
    let back = tokenizers::Tokenizer::from_file(merged.join("tokenizer.json")).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/fixtures/smollm2_reference.json")).unwrap(),
    )
    .unwrap();
    let texts = fixture["texts"].as_array().unwrap();
    assert!(texts
        .iter()
        .any(|t| t.as_str().unwrap().contains("<|im_start|>")));
    for (t, ids) in texts.iter().zip(fixture["ids"].as_array().unwrap()) {
        let want: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
        let got = back.encode(t.as_str().unwrap(), false).unwrap();
        assert_eq!(got.get_ids(), &want[..], "{t}");
        assert_eq!(back.decode(&want, false).unwrap(), t.as_str().unwrap());
    }
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(merged.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let gguf = Gguf::open(&root().join(GGUF)).unwrap();
    let token = |key: &str| {
        let id = gguf.meta(key).unwrap().to_u32().unwrap() as usize;
        gguf.meta("tokenizer.ggml.tokens")
            .unwrap()
            .to_vec()
            .unwrap()[id]
            .to_string()
            .unwrap()
            .clone()
    };
    assert_eq!(config["bos_token"], token("tokenizer.ggml.bos_token_id"));
    assert_eq!(config["eos_token"], token("tokenizer.ggml.eos_token_id"));
    assert_eq!(
        config["pad_token"],
        token("tokenizer.ggml.padding_token_id")
    );
    assert_eq!(
        config["chat_template"],
        gguf.meta("tokenizer.chat_template")
            .unwrap()
            .to_string()
            .unwrap()
            .as_str()
    );
    assert_eq!(config["tokenizer_class"], "PreTrainedTokenizerFast");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Tokenizing only a prefix, or the text in two parts cut where `safe_cut` says, gives exactly
/// the ids of the whole text (the example's train/validation split tokenizes each part alone).
#[test]
fn partial_tokenization_equals_the_whole_texts() {
    let tok = TextTokenizer::from_gguf(&Gguf::open(&root().join(GGUF)).unwrap()).unwrap();
    let text = std::fs::read_to_string(root().join(TEXT)).unwrap();
    let all = tok.encode(&text).unwrap();
    let cut = safe_cut(&text, text.len() * 9 / 10);
    assert!(cut < text.len() && text.as_bytes()[cut] == b'\n');
    let (a, b) = (
        tok.encode(&text[..cut]).unwrap(),
        tok.encode(&text[cut..]).unwrap(),
    );
    assert_eq!([a, b].concat(), all);
    for want in [1, 5_000, 100_000] {
        let (ids, bytes) = tok.encode_prefix(&text, want).unwrap();
        assert!(
            ids.len() >= want && bytes < text.len(),
            "{want}: {}",
            ids.len()
        );
        assert_eq!(ids, all[..ids.len()], "{want}");
        assert_eq!(ids, tok.encode(&text[..bytes]).unwrap());
    }
    let (ids, bytes) = tok.encode_prefix(&text, usize::MAX).unwrap();
    assert_eq!((ids, bytes), (all, text.len()));
}
