//! Chat fine-tuning data (src/data/chat.rs, issue 38 items 1 and 4): JSONL reading and its
//! errors, assistant-only labels with SmolLM2's chat template against transformers' ids
//! (tests/fixtures/chat_smollm2.json, made by scripts/chat_fixture.py), the length policy, the
//! held-out split and epoch order, and the Shakespeare dialogue data set with its length
//! distribution.

#![cfg(feature = "tokenizers")]

mod common;

use anyhow::Result;
use std::path::PathBuf;
use wick::data::chat::{
    self, epoch_order, parse_line, percentile, prepare, read_jsonl, shakespeare_dialogues,
    split_held_out, tokenize, ChatExample, TrainOn, Truncation, IGNORE_INDEX,
};
use wick::models::files::Gguf;
use wick::models::tokenizer::{ChatMessage, TextTokenizer};

fn smollm2() -> TextTokenizer {
    let p = common::data_file(
        "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "scripts/fetch_smollm2.sh",
    );
    TextTokenizer::from_gguf(&Gguf::open(&p).unwrap()).unwrap()
}

fn tmp(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wick-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn m(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

fn roles(e: &ChatExample) -> Vec<(&str, &str)> {
    e.messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect()
}

#[test]
fn jsonl_reads_both_formats() -> Result<()> {
    let p = tmp(
        "ok.jsonl",
        concat!(
            r#"{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "id": 7}"#,
            "\n\n",
            r#"{"prompt": "P", "completion": "C"}"#,
            "\n",
            r#"{"prompt": [{"role": "user", "content": "P2"}], "completion": [{"role": "assistant", "content": "C2"}]}"#,
            "\n"
        ),
    );
    let ex = read_jsonl(&p)?;
    assert_eq!(ex.len(), 3);
    assert_eq!(
        roles(&ex[0]),
        [("system", "S"), ("user", "Q"), ("assistant", "A")]
    );
    assert_eq!(roles(&ex[1]), [("user", "P"), ("assistant", "C")]);
    assert_eq!(roles(&ex[2]), [("user", "P2"), ("assistant", "C2")]);
    // written back in the conversational format and read again
    let q = tmp("round.jsonl", "");
    chat::write_jsonl(&q, &ex)?;
    let back = read_jsonl(&q)?;
    assert_eq!(
        back.iter().map(roles).collect::<Vec<_>>(),
        ex.iter().map(roles).collect::<Vec<_>>()
    );
    Ok(())
}

#[test]
fn malformed_lines_name_file_and_line() {
    let good = r#"{"prompt": "P", "completion": "C"}"#;
    let cases = [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (r#"{"text": "x"}"#, "neither \"messages\""),
        (r#"{"prompt": "P"}"#, "no \"completion\""),
        (
            r#"{"prompt": "P", "completion": "C", "messages": []}"#,
            "both",
        ),
        (r#"{"messages": []}"#, "empty"),
        (
            r#"{"messages": [{"role": "user", "content": "Q"}]}"#,
            "no assistant turn",
        ),
        (
            r#"{"messages": [{"role": "tool", "content": "Q"}, {"role": "assistant", "content": "A"}]}"#,
            "role \"tool\"",
        ),
        (
            r#"{"messages": [{"role": "assistant", "content": "A", "weight": 0}]}"#,
            "key \"weight\"",
        ),
        (
            r#"{"messages": [{"role": "assistant", "content": ["A"]}]}"#,
            "content must be a string",
        ),
        (r#"{"messages": [{"content": "A"}]}"#, "no \"role\""),
        (
            r#"{"prompt": "P", "completion": [{"role": "assistant", "content": "C"}]}"#,
            "both strings or both lists",
        ),
    ];
    for (k, (bad, want)) in cases.iter().enumerate() {
        // the bad line is line 3 (after a good line and a blank one)
        let p = tmp(
            &format!("bad{k}.jsonl"),
            &format!("{good}\n\n{bad}\n{good}\n"),
        );
        let e = format!("{:#}", read_jsonl(&p).unwrap_err());
        let at = format!("{}:3", p.display());
        assert!(e.contains(&at), "{bad}: {e}");
        assert!(e.contains(want), "{bad}: {e}");
        assert!(parse_line(bad).is_err());
    }
    let e = format!(
        "{:#}",
        read_jsonl(&PathBuf::from("/nonexistent/x.jsonl")).unwrap_err()
    );
    assert!(e.contains("/nonexistent/x.jsonl"), "{e}");
}

#[test]
fn assistant_masks_cover_each_answer_and_its_end_of_turn() -> Result<()> {
    let tok = smollm2();
    let ex = ChatExample {
        messages: vec![
            m("system", "Be brief."),
            m("user", "Who wrote Hamlet?"),
            m("assistant", "Shakespeare."),
            m("user", "When?"),
            m("assistant", "Around 1600, in London."),
        ],
    };
    let t = tokenize(&ex, &tok, TrainOn::Assistant)?;
    assert_eq!(t.ids.len(), t.labels.len());
    assert_eq!(t.merged_boundaries, 0);
    // the trained runs, decoded
    let mut runs: Vec<Vec<u32>> = Vec::new();
    let mut prev = false;
    for (&id, &l) in t.ids.iter().zip(&t.labels) {
        let on = l != IGNORE_INDEX;
        if on {
            assert_eq!(l, id as i64, "labels are the ids, not shifted");
            if !prev {
                runs.push(Vec::new());
            }
            runs.last_mut().unwrap().push(id);
        }
        prev = on;
    }
    let decoded: Vec<String> = runs.iter().map(|r| tok.decode(r).unwrap()).collect();
    // SmolLM2's ChatML template: the assistant's content, its end-of-turn token <|im_end|>,
    // and the newline the template writes after it
    assert_eq!(
        decoded,
        [
            "Shakespeare.<|im_end|>\n",
            "Around 1600, in London.<|im_end|>\n"
        ]
    );
    // everything else is the prompt side, and TrainOn::All trains on all of it
    let all = tokenize(&ex, &tok, TrainOn::All)?;
    assert_eq!(all.ids, t.ids);
    assert!(all
        .labels
        .iter()
        .zip(&all.ids)
        .all(|(&l, &i)| l == i as i64));
    // the rendered text's ids without special tokens added
    let text = tok.apply_chat_template(&ex.messages, false)?;
    assert_eq!(t.ids, tok.encode_with(&text, false)?);

    // an answer starting with "\n" merges with the template's "assistant\n": counted, and the
    // merged token goes to the answer
    let ex = ChatExample::prompt_completion("Q", "\n\nA line.");
    let t = tokenize(&ex, &tok, TrainOn::Assistant)?;
    assert_eq!(t.merged_boundaries, 1);
    let on: Vec<u32> = t
        .ids
        .iter()
        .zip(&t.labels)
        .filter(|(_, &l)| l != IGNORE_INDEX)
        .map(|(&i, _)| i)
        .collect();
    assert!(tok.decode(&on)?.ends_with("\n\nA line.<|im_end|>\n"));
    Ok(())
}

#[test]
fn ids_and_masks_equal_transformers() -> Result<()> {
    let tok = smollm2();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/chat_smollm2.json"
    );
    let fx: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    assert!(fx["provenance"].as_str().unwrap().contains("transformers"));
    assert_eq!(
        tok.chat_template.as_deref(),
        fx["chat_template"].as_str(),
        "the GGUF's template"
    );
    let cases = fx["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 3);
    for (k, c) in cases.iter().enumerate() {
        let ex = ChatExample {
            messages: c["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| m(x["role"].as_str().unwrap(), x["content"].as_str().unwrap()))
                .collect(),
        };
        assert_eq!(
            tok.apply_chat_template(&ex.messages, false)?,
            c["text"].as_str().unwrap(),
            "case {k}: rendered text"
        );
        let t = tokenize(&ex, &tok, TrainOn::Assistant)?;
        let want: Vec<u32> = c["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(t.ids, want, "case {k}: ids");
        let mask: Vec<bool> = c["assistant_mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() == 1)
            .collect();
        let ours: Vec<bool> = t.labels.iter().map(|&l| l != IGNORE_INDEX).collect();
        assert_eq!(ours, mask, "case {k}: assistant mask");
    }
    Ok(())
}

#[test]
fn not_prefix_stable_templates_are_refused() -> Result<()> {
    let mut tok = smollm2();
    // a template that renders only the last message: earlier renders are not prefixes
    tok.chat_template = Some(
        "{{ messages[-1]['role'] }}: {{ messages[-1]['content'] }}\n\
         {% if add_generation_prompt %}assistant: {% endif %}"
            .into(),
    );
    let ex = ChatExample {
        messages: vec![
            m("user", "Q"),
            m("assistant", "A"),
            m("user", "Q2"),
            m("assistant", "B"),
        ],
    };
    let e = format!("{:#}", tokenize(&ex, &tok, TrainOn::Assistant).unwrap_err());
    assert!(e.contains("not prefix-stable") && e.contains("turn"), "{e}");
    let e = format!(
        "{:#}",
        prepare(
            std::slice::from_ref(&ex),
            &tok,
            TrainOn::Assistant,
            100,
            Truncation::Drop
        )
        .unwrap_err()
    );
    assert!(e.contains("example 0"), "{e}");
    // TrainOn::All needs no prefixes
    assert!(tokenize(&ex, &tok, TrainOn::All).is_ok());
    Ok(())
}

#[test]
fn length_policy_counts() -> Result<()> {
    let tok = smollm2();
    let short = ChatExample::prompt_completion("Hi", "Hello.");
    let long_answer = ChatExample::prompt_completion("Hi", &"a very long answer ".repeat(20));
    let long_prompt = ChatExample::prompt_completion(&"a very long question ".repeat(20), "Yes.");
    let n_short = tokenize(&short, &tok, TrainOn::Assistant)?.ids.len();
    let n_prompt = tokenize(&long_prompt, &tok, TrainOn::Assistant)?.ids.len();
    let max_len = n_short + 10;
    assert!(n_prompt > max_len + 10);
    let data = [
        short.clone(),
        long_answer.clone(),
        long_prompt.clone(),
        short,
    ];

    let (kept, r) = prepare(&data, &tok, TrainOn::Assistant, max_len, Truncation::Drop)?;
    assert_eq!(
        (
            r.examples,
            r.kept,
            r.truncated,
            r.dropped_too_long,
            r.dropped_no_targets
        ),
        (4, 2, 0, 2, 0)
    );
    assert!(kept.iter().all(|t| t.ids.len() == n_short));
    assert_eq!(r.tokens, 2 * n_short);

    // keep the start: the long answer is cut (its first tokens trained), the long prompt loses
    // its whole answer and is dropped
    let (kept, r) = prepare(
        &data,
        &tok,
        TrainOn::Assistant,
        max_len,
        Truncation::KeepStart,
    )?;
    assert_eq!(
        (
            r.kept,
            r.truncated,
            r.dropped_too_long,
            r.dropped_no_targets
        ),
        (3, 1, 0, 1)
    );
    assert_eq!(kept[1].ids.len(), max_len);
    assert_eq!(kept[1].labels.len(), max_len);
    assert!(kept[1].trained_targets() > 0);
    assert_eq!(
        r.targets,
        kept.iter().map(|t| t.trained_targets()).sum::<usize>()
    );
    println!("{r}");

    // training on everything keeps the long prompt (its start is trained)
    let (_, r) = prepare(&data, &tok, TrainOn::All, max_len, Truncation::KeepStart)?;
    assert_eq!((r.kept, r.truncated, r.dropped_no_targets), (4, 2, 0));
    assert!(prepare(&data, &tok, TrainOn::All, 1, Truncation::Drop).is_err());
    Ok(())
}

#[test]
fn split_is_deterministic_and_disjoint_and_epochs_shuffle() -> Result<()> {
    let items: Vec<usize> = (0..1000).collect();
    let (tr, te) = split_held_out(items.clone(), 0.1, 7)?;
    assert_eq!((tr.len(), te.len()), (900, 100));
    let (tr2, te2) = split_held_out(items.clone(), 0.1, 7)?;
    assert_eq!((&tr, &te), (&tr2, &te2), "same seed, same split");
    let (_, te3) = split_held_out(items.clone(), 0.1, 8)?;
    assert_ne!(te, te3, "another seed, another split");
    // disjoint, covering, each side in input order
    let mut all: Vec<usize> = tr.iter().chain(&te).copied().collect();
    all.sort();
    assert_eq!(all, items);
    assert!(tr.windows(2).all(|w| w[0] < w[1]) && te.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(split_held_out(items.clone(), 0.0, 1)?.1.len(), 0);
    assert!(split_held_out(items.clone(), 1.0, 1).is_err());
    assert!(
        split_held_out(vec![1, 2], 0.1, 1).is_err(),
        "holds out nothing"
    );

    let e0 = epoch_order(50, 3, 0);
    assert_eq!(e0, epoch_order(50, 3, 0));
    assert_ne!(e0, epoch_order(50, 3, 1));
    let mut s = e0.clone();
    s.sort();
    assert_eq!(s, (0..50).collect::<Vec<_>>());
    Ok(())
}

#[test]
fn scenes_and_dialogues_of_a_play() {
    let md = "# A Play\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter A and B_\n\n\
              **A**  \nFirst line,  \nsecond line.\n\n**B**  \nReply.\n\n_Exit A_\n\n\
              **B**  \nMore from B.\n\n**C**  \nC speaks.\n\n### SCENE II. Elsewhere.\n\n\
              **D**  \nNew scene.\n\n**A**  \nBack.\n";
    let s = chat::scenes(md);
    assert_eq!(s.len(), 2);
    assert_eq!(s[0].len(), 4);
    assert_eq!(s[0][0].text, "First line,\nsecond line.");
    let d = chat::play_dialogues(md);
    let pairs: Vec<_> = d
        .iter()
        .map(|e| {
            (
                e.messages[0].content.as_str(),
                e.messages[1].content.as_str(),
            )
        })
        .collect();
    // B -> B is skipped (same speaker); no pair across the scene boundary
    assert_eq!(
        pairs,
        [
            ("First line,\nsecond line.", "Reply."),
            ("More from B.", "C speaks."),
            ("New scene.", "Back.")
        ]
    );
}

#[test]
fn shakespeare_dialogues_counts_and_lengths() -> Result<()> {
    let dir = common::data_file("shakespeare/plays", "scripts/fetch_shakespeare.sh");
    let d = shakespeare_dialogues(&dir)?;
    assert_eq!(d.train_plays.len() + d.held_out_plays.len(), 38);
    assert_eq!(d.held_out_plays.len(), 8);
    assert!(d.train_plays.iter().all(|p| !d.held_out_plays.contains(p)));
    println!(
        "Shakespeare dialogues: {} train examples ({} plays), {} held out ({} plays: {})",
        d.train.len(),
        d.train_plays.len(),
        d.held_out.len(),
        d.held_out_plays.len(),
        d.held_out_plays.join(", ")
    );
    assert!(
        d.train.len() > 15_000 && d.held_out.len() > 3_000,
        "too few"
    );
    for e in d.train.iter().chain(&d.held_out) {
        assert_eq!(e.messages.len(), 2);
        assert!(!e.messages[0].content.is_empty() && !e.messages[1].content.is_empty());
    }

    let tok = smollm2();
    for (name, set) in [("train", &d.train), ("held-out", &d.held_out)] {
        let (toks, r) = prepare(set, &tok, TrainOn::Assistant, 1 << 20, Truncation::Drop)?;
        assert_eq!(r.kept, set.len());
        assert_eq!(r.merged_boundaries, 0);
        let lens: Vec<usize> = toks.iter().map(|t| t.ids.len()).collect();
        println!(
            "{name}: {} examples, {}; {} tokens, {} trained",
            set.len(),
            lengths(&toks),
            r.tokens,
            r.targets
        );
        for m in [512, 1024] {
            let over = lens.iter().filter(|&&l| l > m).count();
            println!("  over {m} tokens: {over}");
        }
    }
    Ok(())
}

/// `data/<rel>` when scripts/fetch_chitchat.sh has been run; `None` (with a printed note) when
/// not: the Chit-Chat data set is optional for now (CI does not fetch it yet).
fn chitchat_file(rel: &str) -> Option<PathBuf> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data/chitchat")
        .join(rel);
    if p.exists() {
        Some(p)
    } else {
        println!(
            "skipped: {} is missing (run scripts/fetch_chitchat.sh to fetch it)",
            p.display()
        );
        None
    }
}

/// The Chit-Chat Challenge conversations (PyPI chitchat-dataset==0.9.0, MIT), converted by
/// scripts/chitchat_to_jsonl.py: every line read, the turns alternate user / assistant and end
/// on the assistant, and every example tokenizes with SmolLM2's template; prints the length
/// distribution.
#[test]
fn chitchat_conversations_read_and_lengths() -> Result<()> {
    let (Some(train), Some(eval)) = (chitchat_file("train.jsonl"), chitchat_file("eval.jsonl"))
    else {
        return Ok(());
    };
    let train = read_jsonl(&train)?;
    let eval = read_jsonl(&eval)?;
    assert_eq!((train.len(), eval.len()), (10_086, 469));
    for e in train.iter().chain(&eval) {
        let n = e.messages.len();
        assert!((2..=16).contains(&n) && n % 2 == 0, "{n} turns");
        for (k, m) in e.messages.iter().enumerate() {
            let want = if k % 2 == 0 { "user" } else { "assistant" };
            assert_eq!(m.role, want);
            assert!(!m.content.is_empty() && m.content.trim() == m.content);
        }
    }

    let tok = smollm2();
    for (name, set) in [("train", &train), ("held-out", &eval)] {
        let (toks, r) = prepare(set, &tok, TrainOn::Assistant, 1 << 20, Truncation::Drop)?;
        assert_eq!(r.kept, set.len());
        assert_eq!(r.merged_boundaries, 0);
        println!("Chit-Chat {name}: {r}");
        let lens: Vec<usize> = toks.iter().map(|t| t.ids.len()).collect();
        let turns: Vec<usize> = set.iter().map(|e| e.messages.len()).collect();
        println!(
            "{name}: {} examples, turns p50 {} p90 {}; {}",
            set.len(),
            percentile(&turns, 50.0),
            percentile(&turns, 90.0),
            lengths(&toks),
        );
        for m in [512, 1024, 2048] {
            let over = lens.iter().filter(|&&l| l > m).count();
            println!("  over {m} tokens: {over}");
        }
    }
    Ok(())
}

/// The length distribution of tokenized examples: tokens per example (p50, p90, p99, max) and
/// assistant (trained) tokens (p50, p90, max).
fn lengths(toks: &[wick::data::chat::Tokenized]) -> String {
    let lens: Vec<usize> = toks.iter().map(|t| t.ids.len()).collect();
    let ans: Vec<usize> = toks.iter().map(|t| t.trained_targets()).collect();
    let p = |v: &[usize], q: f64| percentile(v, q);
    format!(
        "tokens per example (SmolLM2 template) p50 {} p90 {} p99 {} max {}; assistant tokens \
         p50 {} p90 {} max {}",
        p(&lens, 50.0),
        p(&lens, 90.0),
        p(&lens, 99.0),
        p(&lens, 100.0),
        p(&ans, 50.0),
        p(&ans, 90.0),
        p(&ans, 100.0)
    )
}
