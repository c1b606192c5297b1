//! Reading a checkpoint back: `trainer_state.json`, validation of both tensor files against
//! the engine, and applying them (see [`super::load`]).

use super::*;

/// Reads and validates `trainer_state.json` of the checkpoint at `path` (format name and
/// version), without touching the tensor files: to inspect `extra`, the step or the engine
/// state before building a model.
///
/// Errors: the file is missing, unreadable, not valid JSON, or of another format version;
/// the message names the file.
pub fn read_state(path: impl AsRef<Path>) -> Result<TrainerState> {
    let path = path.as_ref();
    let file = path.join(STATE_FILE);
    if !file.exists() {
        let hint = if path.is_dir() && list_checkpoints(path).is_ok_and(|l| !l.is_empty()) {
            " (this looks like a checkpoint root: pass checkpoint::latest(dir) instead)"
        } else {
            ""
        };
        bail!(
            "checkpoint {}: {STATE_FILE} is missing{hint}",
            path.display()
        );
    }
    let bytes =
        fs::read(&file).with_context(|| format!("checkpoint {}: cannot read", file.display()))?;
    let raw: serde_json::Value = serde_json::from_slice(&bytes).with_context(|| {
        format!(
            "checkpoint {}: not valid JSON (corrupt or truncated file)",
            file.display()
        )
    })?;
    let format = raw.get("format").and_then(|v| v.as_str());
    ensure!(
        format == Some(FORMAT_NAME),
        "checkpoint {}: not a wick checkpoint (\"format\" is {:?}, expected {FORMAT_NAME:?})",
        file.display(),
        format
    );
    let version = raw.get("format_version").and_then(|v| v.as_u64());
    let writer = raw
        .get("wick_version")
        .and_then(|v| v.as_str())
        .unwrap_or("?");
    ensure!(
        version == Some(FORMAT_VERSION as u64),
        "checkpoint {}: wrong version: format_version {} (written by wick {writer}); this wick {} \
         reads format_version {FORMAT_VERSION}",
        file.display(),
        version.map_or_else(|| "missing".to_string(), |v| v.to_string()),
        env!("CARGO_PKG_VERSION")
    );
    let state: TrainerState = serde_json::from_value(raw)
        .with_context(|| format!("checkpoint {}: invalid trainer state", file.display()))?;
    state
        .engine
        .scaler
        .validate()
        .with_context(|| format!("checkpoint {}: engine.scaler", file.display()))?;
    ensure!(
        state.engine.applied_steps <= state.engine.boundaries,
        "checkpoint {}: engine.applied_steps {} > engine.boundaries {}",
        file.display(),
        state.engine.applied_steps,
        state.engine.boundaries
    );
    Ok(state)
}

/// Loads the checkpoint directory `path` (a `step-N` directory) into `engine`: masters (and
/// working copies re-derived from them), optimizer state, counters and scaler state. Returns
/// the `extra` JSON given to [`Checkpointer::save`] in [`Resumed::extra`], and in
/// [`Resumed::notices`] a [`ResumeNotice::PrecisionChanged`] when the checkpoint was saved in
/// another precision than the engine's (allowed: masters are f32).
///
/// Everything is validated before the engine is changed: format version, size and SHA-256 of
/// both tensor files, safetensors structure, that `model.safetensors` holds exactly the
/// model's parameters as f32 tensors of the right shapes, and that every optimizer-state
/// tensor belongs to a parameter. Errors name the file and what is wrong (missing tensor,
/// unexpected tensor, shape or dtype mismatch, truncated or corrupt file, checksum mismatch,
/// wrong version); the engine is then unchanged. The checkpoint on disk is only read.
///
/// Data parallel ([`Engine::with_collective`]): a collective call; every rank calls it with
/// the same checkpoint. The ranks agree after validating and after applying: all succeed, or
/// all return an error (the engine state rolled back).
pub fn load(path: impl AsRef<Path>, engine: &mut Engine) -> Result<Resumed> {
    load_checked(path.as_ref(), engine, Vec::new(), false)
}

/// [`load`], with `skipped` (newer incomplete folders a resume passed over) put before the
/// load's own notices; with `exact`, any notice is an error before the engine is changed.
pub(super) fn load_checked(
    path: &Path,
    engine: &mut Engine,
    skipped: Vec<ResumeNotice>,
    exact: bool,
) -> Result<Resumed> {
    let started = Instant::now();
    // read and validate everything first; under data parallelism every rank then agrees before
    // anything collective runs (a rank that failed alone would leave the others waiting)
    let checked = validate(path, engine).and_then(|mut v| {
        v.notices.splice(0..0, skipped);
        if exact && !v.notices.is_empty() {
            let list: Vec<String> = v.notices.iter().map(|n| n.to_string()).collect();
            bail!(
                "resuming from {} is not an exact continuation (Checkpointer::exact): {}; \
                 nothing was loaded",
                path.display(),
                list.join("; ")
            );
        }
        Ok(v)
    });
    agree_across_ranks(engine, checked.is_ok(), "reading the checkpoint")?;
    let Validated {
        state,
        model,
        optim,
        model_file,
        optim_file,
        notices,
    } = checked?;

    // apply: the engine first (atomic: it checks the optimizer map before changing anything),
    // then the masters (checked above, so only a device error can fail there). The rollback
    // snapshot is this rank's own optimizer state (under ZeRO-1 its share, no gathering).
    let rollback = match engine.state() {
        Ok(s) => Some((
            s,
            engine
                .optimizer()
                .state_tensors(&engine.store().params())?
                .into_iter()
                .collect::<HashMap<String, Tensor>>(),
        )),
        Err(_) => None,
    };
    let applied = apply(engine, &state, &optim, &model, &optim_file, &model_file);
    // under data parallelism: every rank succeeded, or every rank rolls its engine state back
    if let Err(e) = agree_across_ranks(engine, applied.is_ok(), "applying the checkpoint") {
        if let Some((s, o)) = &rollback {
            let _ = engine.load_state(s, o);
        }
        return Err(e.context(
            "engine state rolled back; the masters hold the checkpoint's values: load again",
        ));
    }
    if let Err(e) = applied {
        let restored = match &rollback {
            Some((s, o)) => engine.load_state(s, o).is_ok(),
            None => false,
        };
        return Err(e.context(if restored {
            "engine state rolled back; the masters may be partly overwritten"
        } else {
            "the engine may be partly restored: load again"
        }));
    }
    tracing::info!(
        "checkpoint {} loaded in {:.3} s",
        path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(Resumed {
        path: path.to_path_buf(),
        extra: state.extra,
        notices,
    })
}

/// Loads the engine state, then the masters.
fn apply(
    engine: &mut Engine,
    state: &TrainerState,
    optim: &HashMap<String, Tensor>,
    model: &HashMap<String, Tensor>,
    optim_file: &Path,
    model_file: &Path,
) -> Result<()> {
    engine
        .load_state(&state.engine, optim)
        .with_context(|| format!("checkpoint {}", optim_file.display()))?;
    engine.store().load_masters(model).with_context(|| {
        format!(
            "checkpoint {}: writing the master weights failed",
            model_file.display()
        )
    })
}

/// A checkpoint read from disk and checked against the engine, not applied yet.
pub(super) struct Validated {
    state: TrainerState,
    model: HashMap<String, Tensor>,
    optim: HashMap<String, Tensor>,
    model_file: PathBuf,
    optim_file: PathBuf,
    notices: Vec<ResumeNotice>,
}

/// Reads and checks the checkpoint at `path` against `engine` (see [`load`]); changes nothing.
pub(super) fn validate(path: &Path, engine: &Engine) -> Result<Validated> {
    let state = read_state(path)?;
    let running = optimizer_name(engine);
    ensure!(
        state.optimizer.is_empty() || state.optimizer == running,
        "checkpoint {}: the optimizer state was written by {}, the engine runs {running}; \
         build the engine with the checkpoint's optimizer",
        path.join(STATE_FILE).display(),
        state.optimizer
    );
    let precision = engine.store().precision().to_string();
    let mut notices = Vec::new();
    if state.precision != precision {
        let notice = ResumeNotice::PrecisionChanged {
            saved: state.precision.clone(),
            running: precision,
        };
        tracing::warn!("checkpoint {}: {notice}", path.display());
        notices.push(notice);
    }
    let (model, optim) = rayon::join(
        || read_checked(path, MODEL_FILE, &state),
        || read_checked(path, OPTIMIZER_FILE, &state),
    );
    let (model, optim) = (model?, optim?);

    // model.safetensors: exactly the model's parameters, f32, same shapes
    let model_file = path.join(MODEL_FILE);
    let params = engine.store().params();
    let missing: Vec<&str> = params
        .iter()
        .filter(|p| !model.contains_key(&p.name))
        .map(|p| p.name.as_str())
        .collect();
    ensure!(
        missing.is_empty(),
        "checkpoint {}: missing tensor(s) {} (the model has {} parameters, the file {} tensors; a different model?)",
        model_file.display(),
        name_list(&missing),
        params.len(),
        model.len()
    );
    let mut unexpected: Vec<&str> = model
        .keys()
        .filter(|k| engine.store().get(k).is_none())
        .map(String::as_str)
        .collect();
    unexpected.sort_unstable();
    ensure!(
        unexpected.is_empty(),
        "checkpoint {}: unexpected tensor(s) {} that the model does not have (a different model?)",
        model_file.display(),
        name_list(&unexpected)
    );
    let mut bad = Vec::new();
    for p in &params {
        let t = &model[&p.name];
        if t.dims() != p.master.dims() {
            bad.push(format!(
                "shape mismatch for {:?}: the file has {:?}, the model expects {:?}",
                p.name,
                t.dims(),
                p.master.dims()
            ));
        } else if t.dtype() != DType::F32 {
            bad.push(format!(
                "dtype mismatch for {:?}: {:?}, master weights are f32",
                p.name,
                t.dtype()
            ));
        }
    }
    ensure!(
        bad.is_empty(),
        "checkpoint {}: {}",
        model_file.display(),
        if bad.len() > 5 {
            format!("{}; and {} more", bad[..5].join("; "), bad.len() - 5)
        } else {
            bad.join("; ")
        }
    );

    // optimizer.safetensors: every entry is "<param>.<field>" of a known parameter, shaped
    // like it (moments) or with one element (counters)
    let optim_file = path.join(OPTIMIZER_FILE);
    let by_name: HashMap<&str, &[usize]> = params
        .iter()
        .map(|p| (p.name.as_str(), p.master.dims()))
        .collect();
    let mut names: Vec<&String> = optim.keys().collect();
    names.sort();
    for name in names {
        let t = &optim[name];
        let owner = name
            .rmatch_indices('.')
            .map(|(i, _)| &name[..i])
            .find(|prefix| by_name.contains_key(prefix));
        let Some(owner) = owner else {
            bail!(
                "checkpoint {}: optimizer state {name:?} belongs to no parameter of the model (a different model?)",
                optim_file.display()
            );
        };
        let pshape = by_name[owner];
        ensure!(
            t.dims() == pshape || t.elem_count() == 1,
            "checkpoint {}: shape mismatch for {name:?}: the file has {:?}, parameter {owner:?} has {:?}",
            optim_file.display(),
            t.dims(),
            pshape
        );
    }
    Ok(Validated {
        state,
        model,
        optim,
        model_file,
        optim_file,
        notices,
    })
}

/// Under data parallelism (a collective of world size > 1 attached to `engine`): every rank
/// reports whether its part of `what` succeeded (an all-reduce MAX of a failure flag, which is
/// also a barrier). A rank whose own part failed gets `Ok` here and returns its own error; the
/// others get an error saying another rank failed. Without a collective: `Ok`.
pub(super) fn agree_across_ranks(engine: &Engine, ok: bool, what: &str) -> Result<()> {
    let Some(c) = engine.collective().filter(|c| c.world_size() > 1) else {
        return Ok(());
    };
    let flag = Tensor::new(&[if ok { 0f32 } else { 1f32 }], engine.store().device())?;
    let failed = c
        .all_reduce_max(&flag)
        .with_context(|| format!("checkpoint: agreeing across ranks on {what}"))?
        .to_vec1::<f32>()?[0];
    ensure!(
        failed == 0.0 || !ok,
        "checkpoint: {what} failed on another rank (rank {} of {} is fine here); see that rank's error",
        c.rank(),
        c.world_size()
    );
    Ok(())
}
