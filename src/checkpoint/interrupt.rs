//! Ctrl-C (SIGINT/SIGTERM/SIGHUP) handling: a flag the training loop polls to save and stop.
//! The flag is per process: under data parallelism decide with [`interrupted_on_any_rank`],
//! so that every rank saves (a collective) at the same step.

use super::*;

// ---------------------------------------------------------------------------------------------
// Ctrl-C

pub(super) static INTERRUPTED: AtomicBool = AtomicBool::new(false);
pub(super) static HANDLER: std::sync::OnceLock<std::result::Result<(), String>> =
    std::sync::OnceLock::new();

/// Installs a handler for SIGINT (Ctrl-C), SIGTERM and SIGHUP that sets the flag read by
/// [`interrupted`]; a second signal exits the process at once with status 130. Call it once
/// before training (later calls are no-ops returning the first call's outcome). The training
/// loop polls [`interrupted`] at a step boundary, saves a checkpoint and stops.
///
/// Errors: another signal handler was already installed through the `ctrlc` crate, or the
/// operating system refused.
pub fn install_interrupt_handler() -> Result<()> {
    HANDLER
        .get_or_init(|| {
            ctrlc::set_handler(|| {
                if INTERRUPTED.swap(true, Ordering::SeqCst) {
                    std::process::exit(INTERRUPTED_EXIT_CODE);
                }
                eprintln!("\ninterrupt: saving a checkpoint at the next step boundary (again to quit now)");
            })
            .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|e| anyhow!("installing the Ctrl-C handler: {e}"))
}

/// The exit status of a process that stops because of an interrupt: 130 (128 + SIGINT), as
/// shells and other tools report Ctrl-C.
pub const INTERRUPTED_EXIT_CODE: i32 = 130;

/// `Some(`[`INTERRUPTED_EXIT_CODE`]`)` once interrupted (see [`interrupted`]), else `None`:
/// a training program that saved and stopped on Ctrl-C ends with
/// `std::process::exit(code)` instead of a success status.
pub fn interrupted_exit_code() -> Option<i32> {
    interrupted().then_some(INTERRUPTED_EXIT_CODE)
}

/// True once SIGINT/SIGTERM/SIGHUP arrived after [`install_interrupt_handler`] (or after
/// [`request_interrupt`]).
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Sets the interrupt flag by hand (e.g. from a time limit or a test).
pub fn request_interrupt() {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Clears the interrupt flag (e.g. after saving, to continue).
pub fn clear_interrupt() {
    INTERRUPTED.store(false, Ordering::SeqCst);
}

/// [`interrupted`] agreed across ranks: true on every rank when any rank was interrupted (an
/// all-reduce MAX of the flag; call it on every rank at the same step). Without a collective
/// (or world size 1): [`interrupted`].
///
/// Errors: the collective fails.
pub fn interrupted_on_any_rank(engine: &Engine) -> Result<bool> {
    let local = interrupted();
    let Some(c) = engine.collective().filter(|c| c.world_size() > 1) else {
        return Ok(local);
    };
    let flag = Tensor::new(&[f32::from(u8::from(local))], engine.store().device())?;
    Ok(c.all_reduce_max(&flag)?.to_vec1::<f32>()?[0] > 0.0)
}
