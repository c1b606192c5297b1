//! Checks a new user would make on the README: its layout lists what `src/` holds (and nothing
//! that is gone), its commands' output folders are git-ignored, the dependency snippet has no
//! placeholder, and the continue (`--resume`) command repeats the model of the run it continues.

use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn readme() -> String {
    std::fs::read_to_string(root().join("README.md")).unwrap()
}

/// The fenced block after `## Layout`.
fn layout(readme: &str) -> String {
    let start = readme.find("## Layout").expect("a Layout section");
    let block = &readme[start..];
    let open = block.find("```").unwrap() + 3;
    let close = open + block[open..].find("```").unwrap();
    block[open..close].to_string()
}

#[test]
fn layout_lists_every_module_and_only_existing_paths() {
    let layout = layout(&readme());
    let listed: Vec<&str> = layout
        .split_whitespace()
        .filter(|w| w.starts_with("src/") || w.starts_with("examples/"))
        .collect();
    for p in &listed {
        assert!(
            root().join(p).exists(),
            "the layout lists {p}, which does not exist"
        );
    }
    for e in std::fs::read_dir(root().join("src")).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let shown = if e.path().is_dir() {
            format!("src/{name}/")
        } else {
            format!("src/{name}")
        };
        let found = listed.iter().any(|l| l.starts_with(&shown))
            || (name == "bin" && listed.iter().any(|l| l.starts_with("src/bin/")));
        assert!(found, "the layout misses {shown}");
    }
}

#[test]
fn output_folders_of_the_readme_commands_are_ignored() {
    let text = readme();
    let ignore = std::fs::read_to_string(root().join(".gitignore")).unwrap();
    let mut dirs: Vec<&str> = text
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0] == "--save-dir")
        .map(|w| w[1])
        .collect();
    dirs.sort();
    dirs.dedup();
    assert!(!dirs.is_empty());
    for d in dirs {
        let top = d.split('/').next().unwrap();
        assert!(
            ignore.lines().any(|l| l.trim_matches('/') == top),
            "{d} (from the README) is not in .gitignore"
        );
    }
}

#[test]
fn dependency_snippet_and_resume_command_are_complete() {
    let text = readme();
    assert!(!text.contains("<this repository's URL>"), "placeholder URL");
    assert!(
        text.contains("wick = { path = "),
        "a path dependency example"
    );
    // every `mnist ... --resume` command names the model when a CNN run is continued
    let cmds: Vec<String> = text
        .split("cargo run")
        .skip(1)
        .map(|c| {
            c.split("\n\n")
                .next()
                .unwrap()
                .split("```")
                .next()
                .unwrap()
                .to_string()
        })
        .filter(|c| c.contains("--example mnist") && c.contains("--resume"))
        .collect();
    assert!(!cmds.is_empty());
    for c in cmds {
        assert!(
            c.contains("--model cnn"),
            "resume command without --model: {c}"
        );
    }
}
