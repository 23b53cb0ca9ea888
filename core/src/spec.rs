//! Model and GPU specifications (TOML), built-in and user-supplied.
//!
//! KV bytes per token is always derived from the model shape, never configured per experiment.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// Why a model or GPU spec could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// Neither a built-in name nor a path to a TOML file.
    #[error("unknown {kind} `{name}` (built-in: {known}); or give a path to a .toml file")]
    Unknown {
        /// `model` or `gpu`.
        kind: &'static str,
        /// The name asked for.
        name: String,
        /// The built-in names, comma-separated.
        known: String,
    },
    /// The spec file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TOML does not parse or a figure is out of range.
    #[error("invalid {kind} spec in {path}: {message}")]
    Invalid {
        /// `model` or `gpu`.
        kind: &'static str,
        /// The file (`<builtin>` for a built-in spec).
        path: String,
        /// What is wrong.
        message: String,
    },
}

/// A decoder-only transformer's shape (what timing and KV size depend on).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Name a run selects it by (e.g. `r1-distill-qwen-32b`).
    pub name: String,
    /// Decoder layers.
    pub layers: u32,
    /// Hidden (model) dimension.
    pub hidden: u32,
    /// Query attention heads.
    pub q_heads: u32,
    /// Key/value heads (GQA; divides `q_heads`); sets the KV cache size.
    pub kv_heads: u32,
    /// Dimension of one attention head.
    pub head_dim: u32,
    /// SwiGLU intermediate size.
    pub intermediate: u32,
    /// Vocabulary size (embedding and LM-head rows).
    pub vocab: u32,
    /// Bytes per weight and per KV element (2 for bf16).
    pub dtype_bytes: u32,
    /// Whether the Q/K/V projections have biases (Qwen); default false.
    #[serde(default)]
    pub qkv_bias: bool,
}

const BUILTIN_MODELS: &[&str] = &[
    include_str!("../specs/models/r1-distill-qwen-32b.toml"),
    include_str!("../specs/models/llama-3-8b.toml"),
    include_str!("../specs/models/qwen-7b.toml"),
    include_str!("../specs/models/qwen3-8b.toml"),
    include_str!("../specs/models/qwen3-32b.toml"),
    include_str!("../specs/models/llama-3.1-70b.toml"),
];

impl ModelSpec {
    /// K and V for every layer: 2 · layers · kv_heads · head_dim · dtype_bytes.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * self.layers as u64 * self.kv_heads as u64 * self.head_dim as u64 * self.dtype_bytes as u64
    }

    /// Parameters of one decoder layer (attention + SwiGLU MLP + norms).
    pub fn layer_params(&self) -> u64 {
        let h = self.hidden as u64;
        let q = self.q_heads as u64 * self.head_dim as u64;
        let kv = self.kv_heads as u64 * self.head_dim as u64;
        let attn = h * (q + 2 * kv) + q * h + if self.qkv_bias { q + 2 * kv } else { 0 };
        let mlp = 3 * h * self.intermediate as u64;
        attn + mlp + 2 * h
    }

    /// All parameters: layers, embedding and (untied) LM head.
    pub fn params(&self) -> u64 {
        self.layers as u64 * self.layer_params() + 2 * self.vocab as u64 * self.hidden as u64 + self.hidden as u64
    }

    /// Bytes of all weights ([`ModelSpec::params`] × `dtype_bytes`).
    pub fn weight_bytes(&self) -> u64 {
        self.params() * self.dtype_bytes as u64
    }

    /// Names of the built-in model specs.
    pub fn builtin_names() -> Vec<String> {
        BUILTIN_MODELS.iter().map(|s| parse_model(s, "<builtin>").expect("builtin model spec").name).collect()
    }

    /// A built-in name (`r1-distill-qwen-32b`, `llama-3-8b`, `qwen-7b`, `qwen3-8b`, `qwen3-32b`,
    /// `llama-3.1-70b`) or a path to a TOML file.
    pub fn load(name_or_path: &str) -> Result<ModelSpec, SpecError> {
        for text in BUILTIN_MODELS {
            let spec = parse_model(text, "<builtin>")?;
            if spec.name == name_or_path {
                return Ok(spec);
            }
        }
        if looks_like_path(name_or_path) {
            let text = read(name_or_path)?;
            return parse_model(&text, name_or_path);
        }
        Err(SpecError::Unknown { kind: "model", name: name_or_path.into(), known: Self::builtin_names().join(", ") })
    }

    fn validate(&self, path: &str) -> Result<(), SpecError> {
        let invalid = |message: String| SpecError::Invalid { kind: "model", path: path.into(), message };
        // Upper bounds far above any published model (Llama-3.1-405B: 126 layers, hidden 16,384,
        // vocab 128 k), low enough that every product below fits in 64 bits.
        let fields = [
            ("layers", self.layers, 4_096),
            ("hidden", self.hidden, 1 << 20),
            ("q_heads", self.q_heads, 1 << 14),
            ("kv_heads", self.kv_heads, 1 << 14),
            ("head_dim", self.head_dim, 1 << 14),
            ("intermediate", self.intermediate, 1 << 22),
            ("vocab", self.vocab, 1 << 24),
            ("dtype_bytes", self.dtype_bytes, 8),
        ];
        for (field, v, max) in fields {
            if v == 0 || v > max {
                return Err(invalid(format!("`{field}` must be in 1..={max}, got {v}")));
            }
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(invalid(format!(
                "`q_heads` ({}) must be a multiple of `kv_heads` ({})",
                self.q_heads, self.kv_heads
            )));
        }
        if self.checked_weight_bytes().is_none() {
            return Err(invalid("the weights' size in bytes overflows 64 bits".into()));
        }
        Ok(())
    }

    /// [`ModelSpec::weight_bytes`] without wrapping: `None` when a product overflows 64 bits.
    fn checked_weight_bytes(&self) -> Option<u64> {
        let h = self.hidden as u64;
        let q = (self.q_heads as u64).checked_mul(self.head_dim as u64)?;
        let kv = (self.kv_heads as u64).checked_mul(self.head_dim as u64)?;
        let qkv = q.checked_add(kv.checked_mul(2)?)?;
        let attn = h.checked_mul(qkv)?.checked_add(q.checked_mul(h)?)?.checked_add(qkv)?;
        let mlp = h.checked_mul(3)?.checked_mul(self.intermediate as u64)?;
        let layer = attn.checked_add(mlp)?.checked_add(h.checked_mul(2)?)?;
        let embed = (self.vocab as u64).checked_mul(h)?.checked_mul(2)?.checked_add(h)?;
        let params = (self.layers as u64).checked_mul(layer)?.checked_add(embed)?;
        params.checked_mul(self.dtype_bytes as u64)
    }
}

fn parse_model(text: &str, path: &str) -> Result<ModelSpec, SpecError> {
    let spec: ModelSpec = toml::from_str(text).map_err(|e| SpecError::Invalid {
        kind: "model",
        path: path.into(),
        message: one_line(&e.to_string()),
    })?;
    spec.validate(path)?;
    Ok(spec)
}

/// An accelerator's peak figures and links.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    /// Name a run selects it by (e.g. `h100-80gb`).
    pub name: String,
    /// Device memory, GB (10⁹ bytes).
    pub memory_gb: f64,
    /// Dense bf16 tensor-core peak, TFLOP/s.
    pub bf16_tflops: f64,
    /// HBM bandwidth, TB/s.
    pub hbm_tbytes_per_s: f64,
    /// Achievable pinned host↔device copy rate, GB/s (KV offload/reload).
    pub host_link_gbytes_per_s: f64,
    /// NVLink bandwidth, GB/s; 0 when absent.
    #[serde(default)]
    pub nvlink_gbytes_per_s: f64,
}

#[derive(Deserialize)]
struct GpuFile {
    gpu: Vec<GpuSpec>,
}

const BUILTIN_GPUS: &str = include_str!("../specs/gpus/builtin.toml");

impl GpuSpec {
    /// Device memory in bytes.
    pub fn memory_bytes(&self) -> u64 {
        (self.memory_gb * 1e9) as u64
    }

    /// The built-in GPU specs.
    pub fn builtins() -> Vec<GpuSpec> {
        let file: GpuFile = toml::from_str(BUILTIN_GPUS).expect("builtin gpu specs parse");
        file.gpu
    }

    /// A built-in name (`h100-80gb`, `h100-96gb`, `a100-80gb`, `v100-32gb`, `l40s`, `h20-141gb`) or a TOML path
    /// holding one `[[gpu]]` table or the fields at top level.
    pub fn load(name_or_path: &str) -> Result<GpuSpec, SpecError> {
        if let Some(g) = Self::builtins().into_iter().find(|g| g.name == name_or_path) {
            return Ok(g);
        }
        if looks_like_path(name_or_path) {
            let text = read(name_or_path)?;
            let invalid = |m: String| SpecError::Invalid { kind: "gpu", path: name_or_path.into(), message: m };
            let spec = match toml::from_str::<GpuFile>(&text) {
                Ok(mut f) if f.gpu.len() == 1 => f.gpu.remove(0),
                Ok(f) => return Err(invalid(format!("expected exactly one [[gpu]] table, found {}", f.gpu.len()))),
                Err(_) => toml::from_str::<GpuSpec>(&text).map_err(|e| invalid(one_line(&e.to_string())))?,
            };
            spec.validate().map_err(invalid)?;
            return Ok(spec);
        }
        let known: Vec<String> = Self::builtins().into_iter().map(|g| g.name).collect();
        Err(SpecError::Unknown { kind: "gpu", name: name_or_path.into(), known: known.join(", ") })
    }
}

impl GpuSpec {
    /// Every figure within a range that spans real accelerators by orders of magnitude either
    /// way: a figure far outside it is a typo, and would make one iteration last years of
    /// simulated time or size a block table beyond memory.
    fn validate(&self) -> Result<(), String> {
        for (field, v, lo, hi) in [
            ("memory_gb", self.memory_gb, 1e-3, 1e5),
            ("bf16_tflops", self.bf16_tflops, 1e-3, 1e6),
            ("hbm_tbytes_per_s", self.hbm_tbytes_per_s, 1e-4, 1e4),
            ("host_link_gbytes_per_s", self.host_link_gbytes_per_s, 1e-3, 1e5),
        ] {
            if !(v.is_finite() && (lo..=hi).contains(&v)) {
                return Err(format!("`{field}` must be in [{lo}, {hi}], got {v}"));
            }
        }
        if !(self.nvlink_gbytes_per_s.is_finite() && (0.0..=1e5).contains(&self.nvlink_gbytes_per_s)) {
            return Err(format!("`nvlink_gbytes_per_s` must be in [0, 100000], got {}", self.nvlink_gbytes_per_s));
        }
        Ok(())
    }
}

/// A TOML error's snippet and caret lines folded into one line, for a one-line error message.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A spec argument names a file (ends in `.toml` or holds a `/`) rather than a built-in.
pub fn looks_like_path(s: &str) -> bool {
    s.ends_with(".toml") || s.contains('/')
}

fn read(path: &str) -> Result<String, SpecError> {
    std::fs::read_to_string(Path::new(path)).map_err(|source| SpecError::Io { path: path.into(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_bytes_per_token_is_derived_from_shape() {
        let m = ModelSpec::load("r1-distill-qwen-32b").unwrap();
        assert_eq!(m.kv_bytes_per_token(), 262_144);
        assert_eq!(ModelSpec::load("llama-3-8b").unwrap().kv_bytes_per_token(), 131_072);
        assert_eq!(ModelSpec::load("qwen-7b").unwrap().kv_bytes_per_token(), 57_344);
        // Arrow's models, from their public config.json; parameters as published (8.2 B, 32.8 B,
        // 70.6 B).
        for (name, kv, params) in [
            ("qwen3-8b", 147_456, 8.0..8.4),
            ("qwen3-32b", 262_144, 32.5..33.0),
            ("llama-3.1-70b", 327_680, 70.4..70.8),
        ] {
            let m = ModelSpec::load(name).unwrap();
            assert_eq!(m.kv_bytes_per_token(), kv, "{name}");
            let p = m.params() as f64 / 1e9;
            assert!(params.contains(&p), "{name}: {p} B parameters");
        }
        // Qwen2.5-32B has 32.8 B parameters.
        let p = m.params() as f64 / 1e9;
        assert!((32.0..33.5).contains(&p), "params {p} B");
        let p8 = ModelSpec::load("llama-3-8b").unwrap().params() as f64 / 1e9;
        assert!((7.9..8.2).contains(&p8), "llama params {p8} B");
    }

    #[test]
    fn unknown_names_list_builtins() {
        let e = ModelSpec::load("gpt-5").unwrap_err().to_string();
        assert!(e.contains("r1-distill-qwen-32b"), "{e}");
        let e = GpuSpec::load("tpu").unwrap_err().to_string();
        assert!(e.contains("h100-96gb"), "{e}");
        assert_eq!(GpuSpec::load("h100-96gb").unwrap().memory_bytes(), 96_000_000_000);
    }

    fn write(dir: &Path, name: &str, text: &str) -> String {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    }

    #[test]
    fn absurd_shapes_and_figures_are_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("kvfleet-spec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = |over: &str| {
            let mut fields = [
                ("layers", "64"),
                ("hidden", "5120"),
                ("q_heads", "40"),
                ("kv_heads", "8"),
                ("head_dim", "128"),
                ("intermediate", "27648"),
                ("vocab", "152064"),
                ("dtype_bytes", "2"),
            ];
            let (k, v) = over.split_once('=').unwrap();
            fields.iter_mut().filter(|f| f.0 == k).for_each(|f| f.1 = v);
            let body: String = fields.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
            format!("name = \"m\"\n{body}")
        };
        // The overflow that divided by zero: 2 · layers · kv_heads · head_dim · dtype wrapped to 0.
        for (over, want) in [
            ("layers=4294967295", "`layers` must be in 1..=4096"),
            ("kv_heads=65536", "`kv_heads` must be in 1..=16384"),
            ("dtype_bytes=16", "`dtype_bytes` must be in 1..=8"),
            ("vocab=0", "`vocab` must be in 1..="),
            ("layers=nan", "layers = nan"),
        ] {
            let p = write(&dir, "m.toml", &model(over));
            let e = ModelSpec::load(&p).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{over}: {e}");
        }
        let p = write(&dir, "m.toml", &model("layers=64"));
        assert_eq!(ModelSpec::load(&p).unwrap().kv_bytes_per_token(), 262_144);
        let gpu = |over: &str| {
            let (k, v) = over.split_once('=').unwrap();
            let mut text = String::from("name = \"g\"\n");
            for (f, d) in [
                ("memory_gb", "80"),
                ("bf16_tflops", "989"),
                ("hbm_tbytes_per_s", "3.35"),
                ("host_link_gbytes_per_s", "53.7"),
            ] {
                text += &format!("{f} = {}\n", if f == k { v } else { d });
            }
            text
        };
        for (over, want) in [
            ("memory_gb=1e12", "`memory_gb` must be in"),
            ("bf16_tflops=1e-9", "`bf16_tflops` must be in"),
            ("hbm_tbytes_per_s=nan", "`hbm_tbytes_per_s` must be in"),
            ("host_link_gbytes_per_s=0", "`host_link_gbytes_per_s` must be in"),
            ("memory_gb=\"lots\"", "invalid type"),
        ] {
            let p = write(&dir, "g.toml", &gpu(over));
            let e = GpuSpec::load(&p).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{over}: {e}");
        }
        let p = write(&dir, "g.toml", &gpu("memory_gb=80"));
        assert_eq!(GpuSpec::load(&p).unwrap().memory_bytes(), 80_000_000_000);
        for g in GpuSpec::builtins() {
            g.validate().unwrap();
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
