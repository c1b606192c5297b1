//! Checks a new user would make on the README and the docs: the README's layout lists what
//! `src/` holds (and nothing that is gone), the commands' output folders are git-ignored, the
//! dependency snippet has no placeholder, the continue (`--resume`) command repeats the model of
//! the run it continues, every relative link resolves (headings included), no tracked file
//! points outside the repository, and the reference scripts copied into `scripts/reference/`
//! still match their originals when those sit beside the checkout.

use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn readme() -> String {
    std::fs::read_to_string(root().join("README.md")).unwrap()
}

/// The Markdown files whose commands and links are checked: the README, `docs/*.md` and the
/// two index READMEs.
fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![
        root().join("README.md"),
        root().join("results/README.md"),
        root().join("scripts/reference/README.md"),
    ];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("a docs/ folder")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    assert!(!docs.is_empty(), "docs/ has no .md files");
    files.extend(docs);
    files
}

/// The README and every doc, one text (the commands they show).
fn readme_and_docs() -> String {
    markdown_files()
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect::<Vec<_>>()
        .join("\n\n")
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
    let text = readme_and_docs();
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
            "{d} (from the README or docs/) is not in .gitignore"
        );
    }
}

#[test]
fn dependency_snippet_and_resume_command_are_complete() {
    let readme = readme();
    assert!(
        !readme.contains("<this repository's URL>"),
        "placeholder URL"
    );
    assert!(
        readme.contains("wick = { path = "),
        "a path dependency example"
    );
    let text = readme_and_docs();
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

/// Text outside fenced code blocks, line by line (links and headings are not read inside them).
fn prose_lines(text: &str) -> Vec<&str> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push(line);
        }
    }
    out
}

/// GitHub's anchors for a Markdown file's headings: lower case, only letters, digits, `-`
/// and `_` kept, spaces as `-`, a repeated anchor suffixed `-1`, `-2`, ...
fn anchors(text: &str) -> Vec<String> {
    let mut seen: Vec<String> = Vec::new();
    let mut out = Vec::new();
    for line in prose_lines(text) {
        let t = line.trim_start();
        if !t.starts_with('#') {
            continue;
        }
        let title = t.trim_start_matches('#');
        if !title.starts_with(' ') {
            continue;
        }
        let slug: String = title
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.iter().filter(|s| **s == slug).count();
        out.push(if n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        seen.push(slug);
    }
    out
}

/// The targets of the inline links `[text](target)` of a Markdown text, outside code blocks
/// and code spans.
fn link_targets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose_lines(text) {
        // drop code spans, whose brackets are not links
        let mut plain = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                plain.push_str(part);
            }
        }
        let mut rest = plain.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            out.push(target.to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn relative_links_in_readme_and_docs_resolve() {
    let mut broken = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(root()).unwrap().display().to_string();
        for target in link_targets(&text) {
            if target.is_empty()
                || target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let dest = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            if !dest.exists() {
                broken.push(format!("{name}: {target} (no such file)"));
                continue;
            }
            if let Some(a) = anchor {
                if dest.extension().is_some_and(|x| x == "md") {
                    let heads = anchors(&std::fs::read_to_string(&dest).unwrap());
                    if !heads.iter().any(|h| h == a) {
                        broken.push(format!("{name}: {target} (no heading with that anchor)"));
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Every tracked file (`git ls-files`; without git, every file outside target*/, data/, runs/
/// and .git/).
fn tracked_files() -> Vec<PathBuf> {
    let out = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root())
        .output();
    if let Ok(out) = out {
        if out.status.success() {
            return out
                .stdout
                .split(|b| *b == 0)
                .filter(|p| !p.is_empty())
                .map(|p| root().join(String::from_utf8_lossy(p).as_ref()))
                .collect();
        }
    }
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                let skip = name == ".git"
                    || name.starts_with("target")
                    || ((name == "data" || name == "runs") && dir == root());
                if !skip {
                    walk(&p, out);
                }
            } else {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(root(), &mut out);
    out
}

#[test]
fn no_tracked_file_points_outside_the_repository() {
    // The team's folder beside the checkout travels with no clone of this repository: what a
    // file needs from it is copied in (scripts/reference/, docs/cuda.md, docs/data.md).
    let outside = concat!("..", "/shared");
    let needle = outside.as_bytes();
    let mut hits = Vec::new();
    for path in tracked_files() {
        let Ok(bytes) = std::fs::read(&path) else {
            continue; // deleted in the working tree, or not a file
        };
        if bytes.windows(needle.len()).any(|w| w == needle) {
            hits.push(path.strip_prefix(root()).unwrap().display().to_string());
        }
    }
    assert!(
        hits.is_empty(),
        "these files name {outside}, outside the repository (copy what they need in): {hits:?}"
    );
}

#[test]
fn reference_copies_match_their_originals() {
    // The originals sit in the team's folder beside the checkout, when there is one (not in CI).
    let team = root().parent().unwrap().join("shared");
    if !team.is_dir() {
        eprintln!("no team folder beside the checkout: the copies are not compared");
        return;
    }
    let unchanged = [
        (
            "reference/torch_reference.py",
            "scripts/reference/torch_reference.py",
        ),
        ("reference/torch_ddp.py", "scripts/reference/torch_ddp.py"),
        (
            "reference/torch_llama.py",
            "scripts/reference/torch_llama.py",
        ),
        (
            "reference/torch_llama_scale.py",
            "scripts/reference/torch_llama_scale.py",
        ),
        ("reference/torch_sdpa.py", "scripts/reference/torch_sdpa.py"),
        (
            "reference/make_meta_gguf.py",
            "scripts/reference/make_meta_gguf.py",
        ),
        ("cuda/device-env.sh", "scripts/reference/device-env.sh"),
    ];
    for (original, copy) in unchanged {
        let a = std::fs::read(team.join(original)).unwrap();
        let b = std::fs::read(root().join(copy)).unwrap();
        assert!(
            a == b,
            "{copy} differs from the team's {original}: copy it again"
        );
    }
    // the vendored toolchain script: everything below its 8-line header is the original's body
    let original = std::fs::read_to_string(team.join("cuda/setup-cuda-toolchain.sh")).unwrap();
    let vendored = std::fs::read_to_string(root().join(".ci/setup-cuda-toolchain.sh")).unwrap();
    let body = |s: &str, skip: usize| s.split_inclusive('\n').skip(skip).collect::<String>();
    assert!(
        body(&vendored, 8) == body(&original, 1),
        ".ci/setup-cuda-toolchain.sh differs from the team's cuda/setup-cuda-toolchain.sh below its header"
    );
}
