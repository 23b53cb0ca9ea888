//! Model and GPU specifications (TOML), built-in and user-supplied.
//!
//! KV bytes per token is always derived from the model shape, never configured per experiment.

use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("unknown {kind} `{name}` (built-in: {known}); or give a path to a .toml file")]
    Unknown { kind: &'static str, name: String, known: String },
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("invalid {kind} spec in {path}: {message}")]
    Invalid { kind: &'static str, path: String, message: String },
}

/// A decoder-only transformer's shape (what timing and KV size depend on).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    pub layers: u32,
    pub hidden: u32,
    pub q_heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// SwiGLU intermediate size.
    pub intermediate: u32,
    pub vocab: u32,
    /// Bytes per weight and per KV element (2 for bf16).
    pub dtype_bytes: u32,
    #[serde(default)]
    pub qkv_bias: bool,
}

const BUILTIN_MODELS: &[&str] = &[
    include_str!("../specs/models/r1-distill-qwen-32b.toml"),
    include_str!("../specs/models/llama-3-8b.toml"),
    include_str!("../specs/models/qwen-7b.toml"),
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

    pub fn weight_bytes(&self) -> u64 {
        self.params() * self.dtype_bytes as u64
    }

    pub fn builtin_names() -> Vec<String> {
        BUILTIN_MODELS.iter().map(|s| parse_model(s, "<builtin>").expect("builtin model spec").name).collect()
    }

    /// A built-in name (`r1-distill-qwen-32b`, `llama-3-8b`, `qwen-7b`) or a path to a TOML file.
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
        let fields = [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("q_heads", self.q_heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate", self.intermediate),
            ("vocab", self.vocab),
            ("dtype_bytes", self.dtype_bytes),
        ];
        for (field, v) in fields {
            if v == 0 {
                return Err(SpecError::Invalid {
                    kind: "model",
                    path: path.into(),
                    message: format!("`{field}` must be > 0"),
                });
            }
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(SpecError::Invalid {
                kind: "model",
                path: path.into(),
                message: format!("`q_heads` ({}) must be a multiple of `kv_heads` ({})", self.q_heads, self.kv_heads),
            });
        }
        Ok(())
    }
}

fn parse_model(text: &str, path: &str) -> Result<ModelSpec, SpecError> {
    let spec: ModelSpec = toml::from_str(text).map_err(|e| SpecError::Invalid {
        kind: "model",
        path: path.into(),
        message: e.to_string(),
    })?;
    spec.validate(path)?;
    Ok(spec)
}

/// An accelerator's peak figures and links.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    pub name: String,
    pub memory_gb: f64,
    /// Dense bf16 tensor-core peak, TFLOP/s.
    pub bf16_tflops: f64,
    /// HBM bandwidth, TB/s.
    pub hbm_tbytes_per_s: f64,
    /// Achievable pinned host↔device copy rate, GB/s (KV offload/reload).
    pub host_link_gbytes_per_s: f64,
    #[serde(default)]
    pub nvlink_gbytes_per_s: f64,
}

#[derive(Deserialize)]
struct GpuFile {
    gpu: Vec<GpuSpec>,
}

const BUILTIN_GPUS: &str = include_str!("../specs/gpus/builtin.toml");

impl GpuSpec {
    pub fn memory_bytes(&self) -> u64 {
        (self.memory_gb * 1e9) as u64
    }

    pub fn builtins() -> Vec<GpuSpec> {
        let file: GpuFile = toml::from_str(BUILTIN_GPUS).expect("builtin gpu specs parse");
        file.gpu
    }

    /// A built-in name (`h100-80gb`, `h100-96gb`, `a100-80gb`, `v100-32gb`, `l40s`) or a TOML path
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
                Err(_) => toml::from_str::<GpuSpec>(&text).map_err(|e| invalid(e.to_string()))?,
            };
            for (field, v) in [
                ("memory_gb", spec.memory_gb),
                ("bf16_tflops", spec.bf16_tflops),
                ("hbm_tbytes_per_s", spec.hbm_tbytes_per_s),
                ("host_link_gbytes_per_s", spec.host_link_gbytes_per_s),
            ] {
                if !(v.is_finite() && v > 0.0) {
                    return Err(invalid(format!("`{field}` must be a positive number, got {v}")));
                }
            }
            return Ok(spec);
        }
        let known: Vec<String> = Self::builtins().into_iter().map(|g| g.name).collect();
        Err(SpecError::Unknown { kind: "gpu", name: name_or_path.into(), known: known.join(", ") })
    }
}

fn looks_like_path(s: &str) -> bool {
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
}
