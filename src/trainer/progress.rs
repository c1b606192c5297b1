//! The progress bar of the [`super::Trainer`] and `wick finetune`: indicatif's with the `cli`
//! feature, and without it a hidden stand-in with the few methods they call (the run prints
//! its log lines as before, just with no bar).

#[cfg(feature = "cli")]
pub(crate) use indicatif::ProgressBar;

/// The progress bar of a run of `len` optimizer steps, hidden unless `show` (the
/// [`super::Trainer`]'s and `wick finetune`'s).
#[cfg(feature = "cli")]
pub(crate) fn progress_bar(len: u64, show: bool) -> ProgressBar {
    use indicatif::ProgressStyle;
    let bar = match show {
        true => ProgressBar::new(len),
        false => ProgressBar::hidden(),
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// A hidden progress bar (built without the `cli` feature): every method does nothing but
/// run what it is given.
#[cfg(not(feature = "cli"))]
#[derive(Debug, Clone, Default)]
pub(crate) struct ProgressBar;

#[cfg(not(feature = "cli"))]
impl ProgressBar {
    pub(crate) fn inc(&self, _delta: u64) {}
    pub(crate) fn set_message(&self, _msg: String) {}
    pub(crate) fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        f()
    }
    pub(crate) fn finish_and_clear(&self) {}
}

/// Without the `cli` feature: a hidden bar whatever `show` says.
#[cfg(not(feature = "cli"))]
pub(crate) fn progress_bar(_len: u64, _show: bool) -> ProgressBar {
    ProgressBar
}
