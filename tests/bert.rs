//! wick's BERT against candle-transformers' `BertModel`, sentence-transformers and a composed
//! reference, on the real all-MiniLM-L6-v2 weights (scripts/fetch_minilm.sh, which `.ci/run`
//! calls) and a tiny random config; plus the silent no-gradient trap of candle-transformers'
//! `BertModel` on `ParamStore::var_builder()`, pinned by name.

#![cfg(feature = "tokenizers")]

mod common;
use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use candle_transformers::models::bert as ct;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use wick::coverage::Coverage;
use wick::models::bert::{l2_normalize, mean_pool, ClassifierHead, PaddedBatch, Recompute};
use wick::models::{bert_io, Bert, BertConfig};
use wick::{Engine, EngineConfig, ParamStore, Precision};

fn model_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/minilm");
    assert!(
        d.join("model.safetensors").exists(),
        "{} is missing: run scripts/fetch_minilm.sh first",
        d.display()
    );
    d
}

/// tokenizer.json pads every encoding to 128 tokens: turned off (we pad per batch).
fn tokenizer() -> tokenizers::Tokenizer {
    let mut t = tokenizers::Tokenizer::from_file(model_dir().join("tokenizer.json"))
        .expect("tokenizer.json");
    t.with_padding(None);
    t
}

const SENTENCES: [&str; 3] = [
    "To be, or not to be, that is the question.",
    "Shall I compare thee to a summer's day?",
    "Now is the winter of our discontent made glorious summer by this sun of York.",
];

fn encode(texts: &[&str]) -> Vec<Vec<u32>> {
    let tok = tokenizer();
    texts
        .iter()
        .map(|t| tok.encode(*t, true).expect("encode").get_ids().to_vec())
        .collect()
}

/// wick's encoder with the pretrained weights, f32 on the CPU.
fn pretrained() -> Result<(ParamStore, Bert)> {
    let dir = model_dir();
    let config = BertConfig::from_json_file(&dir.join("config.json"))?;
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let bert = Bert::new(&store, config)?;
    let report = bert_io::load_pretrained(&store, &dir.join("model.safetensors"))?;
    assert_eq!(report.loaded, 101);
    assert_eq!(
        report.ignored,
        vec![
            "embeddings.position_ids",
            "pooler.dense.bias",
            "pooler.dense.weight"
        ]
    );
    assert!(report.unexpected.is_empty(), "{:?}", report.unexpected);
    Ok((store, bert))
}

/// candle-transformers' BertModel reading `file` directly (plain candle, f32).
fn reference(file: &Path, config_json: &Path) -> Result<ct::BertModel> {
    let config: ct::Config = serde_json::from_str(&std::fs::read_to_string(config_json)?)?;
    // SAFETY: the file is not modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[file], DType::F32, &Device::Cpu)? };
    Ok(ct::BertModel::load(vb, &config)?)
}

fn reference_forward(m: &ct::BertModel, b: &PaddedBatch) -> Result<Tensor> {
    let (n, t) = b.ids.dims2()?;
    let mut mask = Vec::with_capacity(n * t);
    for &l in &b.lengths {
        mask.extend((0..t).map(|j| u32::from(j < l)));
    }
    let mask = Tensor::from_vec(mask, (n, t), &Device::Cpu)?;
    Ok(m.forward(&b.ids, &b.ids.zeros_like()?, Some(&mask))?)
}

fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// [`max_abs`] over each row's real positions `0..lengths[i]` of `(B, T, C)` hidden states
/// (padded query rows are garbage by design).
fn max_abs_real(a: &Tensor, b: &Tensor, lengths: &[usize]) -> Result<f32> {
    let mut worst = 0f32;
    for (i, &l) in lengths.iter().enumerate() {
        worst = worst.max(max_abs(
            &a.get(i)?.narrow(0, 0, l)?,
            &b.get(i)?.narrow(0, 0, l)?,
        )?);
    }
    Ok(worst)
}

#[test]
fn forward_matches_candle_transformers_on_the_pretrained_weights() -> Result<()> {
    let (_store, bert) = pretrained()?;
    let dir = model_dir();
    let m = reference(&dir.join("model.safetensors"), &dir.join("config.json"))?;
    let batch = PaddedBatch::new(&encode(&SENTENCES), 0, 8, &Device::Cpu)?;
    let ours = bert.forward(&batch)?;
    let theirs = reference_forward(&m, &batch)?;
    assert_eq!(ours.dims(), theirs.dims());
    // compare the real positions (padded query rows are garbage in both)
    let worst = max_abs_real(&ours, &theirs, &batch.lengths)?;
    println!("max |wick - candle-transformers| over real positions: {worst:e}");
    assert!(worst <= 1e-5, "{worst}");
    Ok(())
}

#[derive(serde::Deserialize)]
struct FixtureSentence {
    text: String,
    ids: Vec<u32>,
    embedding: Vec<f32>,
}

#[derive(serde::Deserialize)]
struct Fixture {
    provenance: String,
    model_sha256: String,
    sentences: Vec<FixtureSentence>,
}

#[test]
fn sentence_embedding_and_token_ids_match_sentence_transformers() -> Result<()> {
    // made once on the GPU machine by scripts/minilm_fixture.py (provenance inside the file)
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minilm_embedding.json");
    let f: Fixture = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    println!("fixture: {}", f.provenance);
    assert_eq!(
        f.model_sha256,
        "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
    );
    let (_store, bert) = pretrained()?;
    let texts: Vec<&str> = f.sentences.iter().map(|s| s.text.as_str()).collect();
    let ids = encode(&texts);
    for (s, got) in f.sentences.iter().zip(&ids) {
        assert_eq!(&s.ids, got, "token ids of {:?}", s.text);
    }
    let batch = PaddedBatch::new(&ids, 0, 8, &Device::Cpu)?;
    let emb = l2_normalize(&mean_pool(&bert.forward(&batch)?, &batch.lengths)?)?;
    for (i, s) in f.sentences.iter().enumerate() {
        let want = Tensor::new(s.embedding.as_slice(), &Device::Cpu)?;
        let e = max_abs(&emb.get(i)?, &want)?;
        println!("{:?}: max |wick - sentence-transformers| = {e:e}", s.text);
        assert!(e <= 1e-5, "{}: {e}", s.text);
    }
    Ok(())
}

#[test]
fn candle_transformers_bert_on_var_builder_trains_nothing_but_the_head() -> Result<()> {
    let dir = model_dir();
    let file = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    let config: ct::Config =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let m = ct::BertModel::load(store.var_builder(), &config)?;
    store.load_masters(&file.into_iter().collect())?;
    let head = ClassifierHead::new(&store, "head", 384, 6)?;
    let batch = PaddedBatch::new(&encode(&SENTENCES), 0, 8, &Device::Cpu)?;
    let labels = [0u32, 1, 2];
    let loss = |m: &ct::BertModel| -> candle_core::Result<Tensor> {
        let h = reference_forward(m, &batch).map_err(candle_core::Error::wrap)?;
        let pooled = mean_pool(&h, &batch.lengths).map_err(candle_core::Error::wrap)?;
        wick::models::bert::classification_loss(
            &head.forward(&pooled).map_err(candle_core::Error::wrap)?,
            &labels,
        )
        .map_err(candle_core::Error::wrap)
    };
    let grads = loss(&m)?.backward()?;
    let coverage = Coverage::check(&store.params(), &grads);
    // every encoder tensor of the checkpoint (all but the pooler and the position_ids buffer,
    // which BertModel does not load): candle-nn's fused LayerNorm has no backward, and every
    // parameter sits below one
    let names = safetensors_names(&dir.join("model.safetensors"))?;
    let want: BTreeSet<String> = names
        .into_iter()
        .filter(|n| !n.starts_with("pooler.") && n != "embeddings.position_ids")
        .collect();
    let got: BTreeSet<String> = coverage.missing.iter().cloned().collect();
    assert_eq!(want.len(), 101);
    assert_eq!(
        got, want,
        "the set of parameters without a gradient changed: has candle-nn's LayerNorm gained a \
         backward? Then update this test and the coverage docs"
    );
    assert!(store
        .params()
        .iter()
        .filter(|p| p.name.starts_with("head."))
        .all(|p| grads.get(p.differentiated()).is_some()));
    // the engine refuses the step and names them
    let mut engine = Engine::new(store.clone(), EngineConfig::adamw(1e-4))?;
    let err = engine.step(|_| loss(&m)).unwrap_err().to_string();
    assert!(
        err.contains("101 trainable parameter(s) received no gradient"),
        "{err}"
    );
    assert!(
        err.contains("encoder.layer.5.output.LayerNorm.weight"),
        "{err}"
    );
    Ok(())
}

fn safetensors_names(path: &Path) -> Result<Vec<String>> {
    let bytes = std::fs::read(path)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    Ok(st.names().into_iter().map(str::to_string).collect())
}

#[test]
fn saved_weights_load_back_in_candle_transformers() -> Result<()> {
    let (store, bert) = pretrained()?;
    // change every weight a little, so that a save of the original file would not pass
    for p in store.params() {
        p.master.set(&p.master.affine(1.01, 0.001)?)?;
    }
    store.refresh_working_copies()?;
    let dir = tempdir("saved");
    let config = bert.config().clone();
    bert_io::save_pretrained(
        &store,
        &config,
        &dir,
        Some(&model_dir().join("tokenizer.json")),
    )?;
    assert!(dir.join("tokenizer.json").exists());
    let m = reference(&dir.join("model.safetensors"), &dir.join("config.json"))?;
    let batch = PaddedBatch::new(&encode(&SENTENCES[..2]), 0, 8, &Device::Cpu)?;
    let (ours, theirs) = (bert.forward(&batch)?, reference_forward(&m, &batch)?);
    let e = max_abs_real(&ours, &theirs, &batch.lengths)?;
    assert!(e <= 1e-5, "{e}");
    // and wick loads what it saved
    let again = ParamStore::new(Precision::Fp32, Device::Cpu, 1);
    let bert2 = Bert::new(
        &again,
        BertConfig::from_json_file(&dir.join("config.json"))?,
    )?;
    bert_io::load_pretrained(&again, &dir.join("model.safetensors"))?;
    assert_eq!(max_abs(&bert2.forward(&batch)?, &ours)?, 0.0);
    Ok(())
}

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-bert-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn loading_names_every_missing_and_mis_shaped_tensor_and_changes_nothing() -> Result<()> {
    let config = BertConfig::tiny();
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let _bert = Bert::new(&store, config.clone())?;
    let mut tensors: Vec<(String, Tensor)> = store.masters();
    tensors.retain(|(n, _)| n != "encoder.layer.1.intermediate.dense.bias");
    for (n, t) in tensors.iter_mut() {
        if n == "embeddings.word_embeddings.weight" {
            *t = Tensor::zeros((65, 32), DType::F32, &Device::Cpu)?;
        }
    }
    tensors.push((
        "cls.predictions.bias".into(),
        Tensor::zeros(3, DType::F32, &Device::Cpu)?,
    ));
    let dir = tempdir("bad");
    let file = dir.join("model.safetensors");
    wick::checkpoint::save_safetensors_atomic(&file, tensors)?;
    let before = store
        .get("embeddings.LayerNorm.weight")
        .unwrap()
        .master
        .to_vec1::<f32>()?;
    let other = ParamStore::new(Precision::Fp32, Device::Cpu, 5);
    Bert::new(&other, config)?;
    let err = bert_io::load_pretrained(&other, &file)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("1 tensor(s) missing: encoder.layer.1.intermediate.dense.bias"),
        "{err}"
    );
    assert!(
        err.contains("embeddings.word_embeddings.weight: file [65, 32], model [64, 32]"),
        "{err}"
    );
    let unchanged = other
        .get("embeddings.LayerNorm.weight")
        .unwrap()
        .master
        .to_vec1::<f32>()?;
    assert_eq!(
        unchanged, before,
        "LayerNorm gains start at ones and must be untouched"
    );
    Ok(())
}

/// The same encoder composed from candle's own differentiable ops (layer_norm_slow, the
/// additive-mask softmax, gelu_erf, separate q/k/v matmuls), over the same parameters.
fn composed_forward(store: &ParamStore, c: &BertConfig, b: &PaddedBatch) -> Result<Tensor> {
    let p = |n: &str| store.get(n).unwrap().differentiated().clone();
    let lin = |x: &Tensor, n: &str| -> Result<Tensor> {
        Ok(x.broadcast_matmul(&p(&format!("{n}.weight")).t()?)?
            .broadcast_add(&p(&format!("{n}.bias")))?)
    };
    let ln = |x: &Tensor, n: &str| -> Result<Tensor> {
        Ok(candle_nn::ops::layer_norm_slow(
            x,
            &p(&format!("{n}.weight")),
            &p(&format!("{n}.bias")),
            c.layer_norm_eps as f32,
        )?)
    };
    let (n, t) = b.ids.dims2()?;
    let (h, dh) = (c.num_attention_heads, c.hidden_size / c.num_attention_heads);
    let word = p("embeddings.word_embeddings.weight").index_select(&b.ids.flatten_all()?, 0)?;
    let pos = p("embeddings.position_embeddings.weight").narrow(0, 0, t)?;
    let typ = p("embeddings.token_type_embeddings.weight").narrow(0, 0, 1)?;
    let x = word
        .reshape((n, t, c.hidden_size))?
        .broadcast_add(&pos)?
        .broadcast_add(&typ)?;
    let mut x = ln(&x, "embeddings.LayerNorm")?;
    let mut mask = Vec::new();
    for &l in &b.lengths {
        mask.extend((0..t).map(|j| if j < l { 0f32 } else { f32::MIN }));
    }
    let mask = Tensor::from_vec(mask, (n, 1, 1, t), &Device::Cpu)?;
    for i in 0..c.num_hidden_layers {
        let pre = format!("encoder.layer.{i}");
        let heads = |name: &str| -> Result<Tensor> {
            Ok(lin(&x, &format!("{pre}.attention.self.{name}"))?
                .reshape((n, t, h, dh))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (q, k, v) = (heads("query")?, heads("key")?, heads("value")?);
        let s = (q.matmul(&k.t()?)? / (dh as f64).sqrt())?.broadcast_add(&mask)?;
        let y = candle_nn::ops::softmax(&s, D::Minus1)?.matmul(&v)?;
        let y = y.transpose(1, 2)?.reshape((n, t, c.hidden_size))?;
        let a = ln(
            &(&x + lin(&y, &format!("{pre}.attention.output.dense"))?)?,
            &format!("{pre}.attention.output.LayerNorm"),
        )?;
        let f = lin(
            &lin(&a, &format!("{pre}.intermediate.dense"))?.gelu_erf()?,
            &format!("{pre}.output.dense"),
        )?;
        x = ln(&(&a + f)?, &format!("{pre}.output.LayerNorm"))?;
    }
    Ok(x)
}

#[test]
fn every_gradient_of_a_tiny_bert_matches_the_composed_reference() -> Result<()> {
    let config = BertConfig::tiny();
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 11);
    let bert = Bert::new(&store, config.clone())?;
    let rows: Vec<Vec<u32>> = vec![(1..12).collect(), (20..25).collect(), vec![3, 4]];
    let batch = PaddedBatch::new(&rows, 0, 8, &Device::Cpu)?;
    let r = Tensor::randn(0f32, 1.0, (3, 16, 32), &Device::Cpu)?;
    // weight the real positions only: padded rows differ by design
    let pooled_loss =
        |h: Tensor| -> Result<Tensor> { Ok(mean_pool(&(h * &r)?, &batch.lengths)?.sum_all()?) };
    let ours = pooled_loss(bert.forward(&batch)?)?;
    let theirs = pooled_loss(composed_forward(&store, &config, &batch)?)?;
    let (g1, g2) = (ours.backward()?, theirs.backward()?);
    assert!((ours.to_scalar::<f32>()? - theirs.to_scalar::<f32>()?).abs() < 1e-4);
    let params = store.params();
    assert_eq!(params.len(), 5 + 16 * 2);
    for p in &params {
        let (a, b) = (g1.get(p.differentiated()), g2.get(p.differentiated()));
        let (a, b) = (
            a.unwrap_or_else(|| panic!("{}: no gradient", p.name)),
            b.unwrap(),
        );
        let scale = b
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?
            .max(1e-3);
        let e = max_abs(a, b)? / scale;
        assert!(e < 1e-4, "{}: relative error {e}", p.name);
    }
    Ok(())
}

#[test]
fn the_feed_forward_block_node_gives_the_per_op_loss_and_gradients() -> Result<()> {
    // the engine's path (each feed-forward sub-block one wick::ops::post_norm_block node)
    // against the per-op graph under candle's backward: the same kernels in the same order, so
    // equal exactly, in fp32 and bf16-mixed
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        let store = ParamStore::new(precision, Device::Cpu, 12);
        let bert = Bert::new(&store, BertConfig::tiny())?;
        let rows: Vec<Vec<u32>> = vec![(1..12).collect(), (20..25).collect(), vec![3, 4]];
        let batch = PaddedBatch::new(&rows, 0, 8, &Device::Cpu)?;
        let r = Tensor::randn(0f32, 1.0, (3, 16, 32), &Device::Cpu)?;
        let loss =
            |h: Tensor| -> Result<Tensor> { Ok(mean_pool(&(h * &r)?, &batch.lengths)?.sum_all()?) };
        let what = format!("{precision}");
        common::assert_sink_matches_per_op(&store, &what, || loss(bert.forward(&batch)?))?;
    }
    Ok(())
}

/// `cargo test --release --features cuda --test bert` on a GPU machine.
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    /// Parameter gradients of the pooled loss `sum(mean_pool(h * r))` for a store on `dev`.
    fn grads_on(dev: &Device, precision: Precision) -> Result<(Tensor, Vec<(String, Tensor)>)> {
        let config = BertConfig::tiny();
        let store = ParamStore::new(precision, dev.clone(), 11);
        let bert = Bert::new(&store, config)?;
        let rows: Vec<Vec<u32>> = vec![(1..12).collect(), (20..25).collect(), vec![3, 4]];
        let batch = PaddedBatch::new(&rows, 0, 8, dev)?;
        // candle's CPU randn is not seeded: a fixed pattern, the same on both devices
        let r = Tensor::arange(0f32, (3 * 16 * 32) as f32, &Device::Cpu)?
            .affine(0.37, 0.0)?
            .sin()?
            .reshape((3, 16, 32))?
            .to_device(dev)?;
        let h = bert.forward(&batch)?;
        let loss = mean_pool(&(&h * &r)?, &batch.lengths)?.sum_all()?;
        let g = loss.backward()?;
        let mut out = Vec::new();
        for p in store.params() {
            let gi = g
                .get(p.differentiated())
                .expect("gradient")
                .to_dtype(DType::F32)?;
            out.push((p.name.clone(), gi.to_device(&Device::Cpu)?));
        }
        Ok((h.to_dtype(DType::F32)?.to_device(&Device::Cpu)?, out))
    }

    #[test]
    fn cuda_forward_and_every_gradient_match_the_cpu() -> Result<()> {
        let gpu = Device::new_cuda(0)?;
        let (h_cpu, g_cpu) = grads_on(&Device::Cpu, Precision::Fp32)?;
        for (precision, bound) in [(Precision::Fp32, 1e-4f32), (Precision::Bf16Mixed, 5e-2)] {
            let (h_gpu, g_gpu) = grads_on(&gpu, precision)?;
            let worst = max_abs_real(&h_gpu, &h_cpu, &[11, 5, 2])?;
            println!("{precision}: hidden states max |cuda - cpu| {worst:e}");
            assert!(worst <= bound * 10.0, "{precision}: hidden {worst}");
            for ((n, a), (_, b)) in g_gpu.iter().zip(&g_cpu) {
                let scale = b
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()?
                    .max(1e-3);
                let e = max_abs(a, b)? / scale;
                assert!(e <= bound, "{precision}: {n}: relative error {e}");
            }
        }
        Ok(())
    }

    #[test]
    fn engine_steps_on_cuda_match_the_cpu_with_parameter_groups() -> Result<()> {
        use wick::optim::OptimPath;
        let gpu = Device::new_cuda(0)?;
        let init = train_tiny(&Device::Cpu, Precision::Fp32, OptimPath::Fused, 0)?;
        let cpu = train_tiny(&Device::Cpu, Precision::Fp32, OptimPath::Fused, 6)?;
        for path in [OptimPath::Fused, OptimPath::Reference] {
            let cuda = train_tiny(&gpu, Precision::Fp32, path, 6)?;
            compare_masters(
                &cuda,
                &cpu,
                &init,
                1e-3,
                &format!("fp32 cuda {path:?} vs cpu"),
            )?;
        }
        let cpu_bf16 = train_tiny(&Device::Cpu, Precision::Bf16Mixed, OptimPath::Fused, 6)?;
        let cuda_bf16 = train_tiny(&gpu, Precision::Bf16Mixed, OptimPath::Fused, 6)?;
        compare_masters(&cuda_bf16, &cpu_bf16, &init, 0.1, "bf16-mixed cuda vs cpu")
    }

    #[test]
    fn pretrained_forward_on_cuda_matches_candle_transformers_on_the_cpu() -> Result<()> {
        let dir = model_dir();
        let config = BertConfig::from_json_file(&dir.join("config.json"))?;
        let gpu = Device::new_cuda(0)?;
        let store = ParamStore::new(Precision::Fp32, gpu.clone(), 0);
        let bert = Bert::new(&store, config)?;
        bert_io::load_pretrained(&store, &dir.join("model.safetensors"))?;
        let m = reference(&dir.join("model.safetensors"), &dir.join("config.json"))?;
        let ids = encode(&SENTENCES);
        let ours = bert
            .forward(&PaddedBatch::new(&ids, 0, 8, &gpu)?)?
            .to_device(&Device::Cpu)?;
        let batch = PaddedBatch::new(&ids, 0, 8, &Device::Cpu)?;
        let theirs = reference_forward(&m, &batch)?;
        let worst = max_abs_real(&ours, &theirs, &batch.lengths)?;
        println!("f32 on CUDA vs candle-transformers on the CPU: max {worst:e}");
        // cuBLAS may use TF32-free f32 GEMMs with another summation order
        assert!(worst <= 1e-4, "{worst}");
        Ok(())
    }
}

/// Masters after `steps` engine steps on a tiny BERT + head with two learning-rate groups,
/// decay groups, clipping and a warmup-decay schedule; `dev` and `precision` vary.
fn train_tiny(
    dev: &Device,
    precision: Precision,
    path: wick::optim::OptimPath,
    steps: usize,
) -> Result<Vec<(String, Tensor)>> {
    train_tiny_with(dev, precision, path, steps, Recompute::Off)
}

/// [`train_tiny`] with what the backward recomputes.
fn train_tiny_with(
    dev: &Device,
    precision: Precision,
    path: wick::optim::OptimPath,
    steps: usize,
    recompute: Recompute,
) -> Result<Vec<(String, Tensor)>> {
    let config = BertConfig::tiny();
    let store = ParamStore::new(precision, dev.clone(), 3);
    let mut bert = Bert::new(&store, config.clone())?;
    bert.set_recompute(recompute);
    let head = ClassifierHead::new(&store, "head", config.hidden_size, 4)?;
    store.set_lr_scale("head.*", 10.0)?;
    store.set_weight_decay("*LayerNorm*", false)?;
    let mut ec = EngineConfig::adamw(1e-3);
    ec.schedule = wick::optim::LrSchedule::LinearDecay {
        lr: 1e-3,
        end_lr: 0.0,
        warmup: 2,
        total: steps.max(2) as u64,
    };
    ec.max_grad_norm = Some(0.5);
    ec.path = path;
    let mut engine = Engine::new(store.clone(), ec)?;
    for s in 0..steps {
        let rows: Vec<Vec<u32>> = (0..6)
            .map(|r| {
                (0..(3 + (r * 5 + s) % 12))
                    .map(|j| ((r * 7 + j * 3 + s) % 63 + 1) as u32)
                    .collect()
            })
            .collect();
        let labels: Vec<u32> = (0..6).map(|r| ((r + s) % 4) as u32).collect();
        let batch = PaddedBatch::new(&rows, 0, 8, dev)?;
        engine.step(|_| {
            let h = bert.forward(&batch).map_err(candle_core::Error::wrap)?;
            let pooled = mean_pool(&h, &batch.lengths).map_err(candle_core::Error::wrap)?;
            wick::models::bert::classification_loss(
                &head.forward(&pooled).map_err(candle_core::Error::wrap)?,
                &labels,
            )
            .map_err(candle_core::Error::wrap)
        })?;
    }
    store
        .masters()
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?)))
        .collect()
}

/// Largest |a - b| over the parameters, relative to the largest change |b - init| of each.
/// The key biases are left out: softmax is invariant to adding `q · b_k` to every score of a
/// query, so their exact gradient is 0 and what AdamW makes of the rounding noise left in it
/// differs from device to device.
fn compare_masters(
    a: &[(String, Tensor)],
    b: &[(String, Tensor)],
    init: &[(String, Tensor)],
    bound: f32,
    what: &str,
) -> Result<()> {
    for (((n, x), (_, y)), (_, z)) in a.iter().zip(b).zip(init) {
        if n.ends_with("attention.self.key.bias") {
            continue;
        }
        let moved = max_abs(y, z)?.max(1e-6);
        let e = max_abs(x, y)? / moved;
        assert!(
            e <= bound,
            "{what}: {n}: |a - b| is {e} of its change from init"
        );
    }
    Ok(())
}

#[test]
fn fused_and_reference_optimizers_agree_on_a_tiny_bert_with_parameter_groups() -> Result<()> {
    use wick::optim::OptimPath;
    let init = train_tiny(&Device::Cpu, Precision::Fp32, OptimPath::Fused, 0)?;
    let fused = train_tiny(&Device::Cpu, Precision::Fp32, OptimPath::Fused, 6)?;
    let reference = train_tiny(&Device::Cpu, Precision::Fp32, OptimPath::Reference, 6)?;
    compare_masters(&fused, &reference, &init, 1e-4, "cpu fused vs reference")
}

#[test]
fn a_bert_for_classification_checkpoint_loads_through_its_prefix() -> Result<()> {
    let config = BertConfig::tiny();
    let source = ParamStore::new(Precision::Fp32, Device::Cpu, 7);
    Bert::new(&source, config.clone())?;
    let mut tensors: Vec<(String, Tensor)> = source
        .masters()
        .into_iter()
        .map(|(n, t)| (format!("bert.{n}"), t))
        .collect();
    tensors.push((
        "classifier.weight".into(),
        Tensor::zeros((2, 32), DType::F32, &Device::Cpu)?,
    ));
    let dir = tempdir("prefixed");
    let file = dir.join("model.safetensors");
    wick::checkpoint::save_safetensors_atomic(&file, tensors)?;
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 8);
    Bert::new(&store, config)?;
    let report = bert_io::load_pretrained(&store, &file)?;
    assert_eq!(report.unexpected, vec!["classifier.weight"]);
    let name = "encoder.layer.1.output.dense.weight";
    let want = source
        .get(name)
        .unwrap()
        .master
        .flatten_all()?
        .to_vec1::<f32>()?;
    let got = store
        .get(name)
        .unwrap()
        .master
        .flatten_all()?
        .to_vec1::<f32>()?;
    assert_eq!(got, want);
    Ok(())
}

/// The loss and every parameter's gradient (by name, f32) of a tiny BERT + head on a fixed
/// batch, with what the backward recomputes.
fn loss_and_grads(
    precision: Precision,
    recompute: Recompute,
) -> Result<(f32, Vec<(String, Tensor)>)> {
    let config = BertConfig::tiny();
    let store = ParamStore::new(precision, Device::Cpu, 21);
    let mut bert = Bert::new(&store, config.clone())?;
    bert.set_recompute(recompute);
    assert_eq!(bert.recompute(), recompute);
    let head = ClassifierHead::new(&store, "head", config.hidden_size, 4)?;
    // a non-zero head, so that the encoder's gradients are not all zero
    let hw = store.get("head.weight").unwrap();
    let pattern = Tensor::arange(0f32, (4 * 32) as f32, &Device::Cpu)?
        .affine(0.61, 0.0)?
        .sin()?
        .reshape((4, 32))?;
    hw.master.set(&pattern)?;
    store.refresh_working_copies()?;
    let rows: Vec<Vec<u32>> = vec![
        (1..12).collect(),
        (20..25).collect(),
        vec![3, 4],
        (30..46).collect(),
    ];
    let batch = PaddedBatch::new(&rows, 0, 8, &Device::Cpu)?;
    let h = bert.forward(&batch)?;
    let logits = head.forward(&mean_pool(&h, &batch.lengths)?)?;
    let loss = wick::models::bert::classification_loss(&logits, &[0, 1, 2, 3])?;
    // without recomputation candle's own backward (the reference); with it, the engine's
    // (leaf gradients through wick::grad_sink, the recomputed segments' through their taps)
    let grads = match recompute {
        Recompute::Off => loss.backward()?,
        _ => wick::grad_sink::backward(&loss)?,
    };
    let mut out = Vec::new();
    for p in store.params() {
        let g = grads.get(p.differentiated()).unwrap_or_else(|| {
            panic!(
                "{}: no gradient (recompute {recompute}, {precision})",
                p.name
            )
        });
        out.push((p.name.clone(), g.to_dtype(DType::F32)?));
    }
    Ok((loss.to_scalar::<f32>()?, out))
}

#[test]
fn recomputation_gives_the_same_loss_and_every_gradient() -> Result<()> {
    for (precision, bound) in [(Precision::Fp32, 1e-6f32), (Precision::Bf16Mixed, 1e-6)] {
        let (l0, g0) = loss_and_grads(precision, Recompute::Off)?;
        for recompute in [Recompute::Attention, Recompute::Layer] {
            let (l1, g1) = loss_and_grads(precision, recompute)?;
            assert!(
                (l0 - l1).abs() <= bound * l0.abs(),
                "{precision}: loss {l0} without recomputation, {l1} with {recompute}"
            );
            // 16 per layer, 5 for the embeddings, 2 for the head
            assert_eq!(g0.len(), 5 + 16 * 2 + 2);
            assert_eq!(g1.len(), g0.len());
            let mut worst = 0f32;
            for ((n, a), (_, b)) in g1.iter().zip(&g0) {
                let scale = max_abs(b, &b.zeros_like()?)?;
                assert!(
                    scale > 0.0 || n.ends_with("key.bias"),
                    "{precision}: {n}: zero gradient"
                );
                let e = max_abs(a, b)? / scale.max(1e-6);
                worst = worst.max(e);
                assert!(
                    e <= bound,
                    "{precision} {recompute}: {n}: relative error {e}"
                );
            }
            println!("{precision} {recompute}: loss {l0}, worst relative gradient error {worst:e}");
        }
    }
    Ok(())
}

#[test]
fn engine_steps_with_recomputation_match_those_without() -> Result<()> {
    use wick::optim::OptimPath;
    for (precision, bound) in [(Precision::Fp32, 1e-5f32), (Precision::Bf16Mixed, 1e-5)] {
        let init = train_tiny_with(&Device::Cpu, precision, OptimPath::Fused, 0, Recompute::Off)?;
        let plain = train_tiny_with(&Device::Cpu, precision, OptimPath::Fused, 4, Recompute::Off)?;
        for recompute in [Recompute::Attention, Recompute::Layer] {
            let ckpt = train_tiny_with(&Device::Cpu, precision, OptimPath::Fused, 4, recompute)?;
            compare_masters(
                &ckpt,
                &plain,
                &init,
                bound,
                &format!("{precision}: recompute {recompute} vs off"),
            )?;
        }
    }
    Ok(())
}
