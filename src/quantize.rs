//! Quantized embedding types (Cohere's `embedding_types`): what they are, and the arithmetic.
//!
//! * `int8` / `uint8`: symmetric scalar quantization, `q = clamp(round(v × 127 / r), −128,
//!   127)` (`uint8` is `q + 128`), with one [`Int8Scale`] `r` per space and output width. `r`
//!   belongs to the space, not to a request: every int8 row of a space is quantized with the
//!   same `r`, so rows stay comparable for as long as the space lives (the hub stores the
//!   space's [`Int8Rule`] when first asked, and derives each width's `r` from it and the
//!   space's stored fingerprint; `src/hub/space_scales.rs`). Dequantized,
//!   `v ≈ q × r / 127`; a cosine or a dot product on the codes ranks as the floats do.
//! * `binary` / `ubinary`: the sign bits (`v > 0` is 1), packed eight to a byte, the most
//!   significant bit first, a width that is not a multiple of 8 zero-padded; `ubinary` as
//!   0..=255, `binary` the same bytes offset by −128 (as Cohere and sentence-transformers'
//!   `quantize_embeddings` define them). Hamming distance on them approximates the angle.
//!
//! How `r` is chosen was measured (`scripts/quantization_measure.py`, MiniLM at widths 384, 128
//! and 64 on `tests/fixtures/quantization/`): per-dimension ranges calibrated on 240 texts (the
//! sentence-transformers way) clip 38–97 % of unseen vectors and fall to a cosine of 0.989 at
//! narrow widths; a fixed `r = 1` (the bound of a unit vector) loses precision as the width
//! grows (0.993 at 2 560 dimensions on random unit vectors). One symmetric `r` per width from
//! the largest component of the space's own fingerprint (the reference's probe vectors, cut to
//! the width as served) with a margin of 1.5 clips nothing seen and keeps a dequantized
//! cosine ≥ 0.9998 at every width measured.

use serde::{Deserialize, Serialize};

/// The margin over the fingerprint's largest component: unseen vectors reach further than 12
/// probe texts do (measured: the eval set's largest component is up to 1.09× the probes').
pub const SCALE_MARGIN: f32 = 1.5;

/// An embedding type a client may ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum EmbeddingType {
    Float,
    /// Base64 of the little-endian f32 bytes (OpenAI's and Cohere's layout).
    Base64,
    Int8,
    Uint8,
    Binary,
    Ubinary,
}

impl EmbeddingType {
    pub const ALL: [EmbeddingType; 6] = [
        Self::Float,
        Self::Base64,
        Self::Int8,
        Self::Uint8,
        Self::Binary,
        Self::Ubinary,
    ];

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == name)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Float => "float",
            Self::Base64 => "base64",
            Self::Int8 => "int8",
            Self::Uint8 => "uint8",
            Self::Binary => "binary",
            Self::Ubinary => "ubinary",
        }
    }

    /// Whether it is quantized (not the float vector in some encoding).
    pub fn is_quantized(self) -> bool {
        !matches!(self, Self::Float | Self::Base64)
    }

    /// Whether it needs the space's [`Int8Scale`].
    pub fn needs_scale(self) -> bool {
        matches!(self, Self::Int8 | Self::Uint8)
    }
}

/// The magnitude `r` that int8 maps to 127, for one space at one output width. Always finite
/// and positive.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Int8Scale {
    pub range: f32,
}

/// How a space's int8 scales are derived from its fingerprint, stored with the space once (the
/// first time a client asks for `int8` or `uint8`): every width's scale is then a function of
/// what the space stores, so no width asked later needs a write, and a later build with
/// another rule still derives this space's scales as they were.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Int8Rule {
    /// Which derivation: 1 is [`Int8Rule::scale`]'s (the largest component as served at the
    /// width, times `margin`, at most 1 for unit vectors).
    pub version: u32,
    pub margin: f32,
}

impl Int8Rule {
    /// The rule this build stores for a space that has none.
    pub const CURRENT: Int8Rule = Int8Rule {
        version: 1,
        margin: SCALE_MARGIN,
    };

    /// Whether this build can derive scales by it.
    pub fn is_known(self) -> bool {
        self.version == 1 && self.margin.is_finite() && self.margin > 0.0
    }

    /// The scale of a space at `width`, from its fingerprint as served at that width: each
    /// probe vector cut to `width` and, when the fingerprint's vectors are unit vectors (the
    /// model normalises), renormalised, as the engine's Matryoshka cut is. `r` is `margin` ×
    /// the largest component, never above 1 for unit vectors. `None` when the fingerprint has
    /// nothing at that width, or the rule is not one this build knows. The arithmetic is
    /// plain IEEE sums, products and square roots in a fixed order: every hub derives the
    /// same bits.
    pub fn scale(self, fingerprint: &[Vec<f32>], width: usize) -> Option<Int8Scale> {
        if width == 0 || !self.is_known() {
            return None;
        }
        let norm = |v: &[f32]| {
            v.iter()
                .map(|x| f64::from(*x) * f64::from(*x))
                .sum::<f64>()
                .sqrt()
        };
        // The model normalises when every vector that is not all zeros is a unit vector.
        let norms: Vec<f64> = fingerprint
            .iter()
            .map(|v| norm(v))
            .filter(|n| *n > 0.0)
            .collect();
        let unit = !norms.is_empty() && norms.iter().all(|n| (n - 1.0).abs() < 1e-3);
        let mut largest = 0f64;
        for v in fingerprint.iter().filter(|v| v.len() >= width) {
            let cut = &v[..width];
            let n = if unit { norm(cut) } else { 1.0 };
            if n <= 0.0 || !n.is_finite() {
                continue;
            }
            for x in cut {
                largest = largest.max(f64::from(*x).abs() / n);
            }
        }
        if !(largest.is_finite() && largest > 0.0) {
            return None;
        }
        let mut range = largest * f64::from(self.margin);
        if unit {
            range = range.min(1.0);
        }
        Some(Int8Scale {
            range: range as f32,
        })
    }
}

impl Int8Scale {
    /// The scale of a fingerprint at `width` by [`Int8Rule::CURRENT`].
    pub fn from_fingerprint(fingerprint: &[Vec<f32>], width: usize) -> Option<Self> {
        Int8Rule::CURRENT.scale(fingerprint, width)
    }

    /// Whether a stored scale can be used (finite, positive).
    pub fn is_valid(self) -> bool {
        self.range.is_finite() && self.range > 0.0
    }

    /// `clamp(round(v × 127 / r), −128, 127)`, halves away from zero.
    pub fn int8(self, v: &[f32]) -> Vec<i8> {
        let k = 127.0 / f64::from(self.range);
        v.iter()
            .map(|x| (f64::from(*x) * k).round().clamp(-128.0, 127.0) as i8)
            .collect()
    }

    /// The int8 codes offset by 128.
    pub fn uint8(self, v: &[f32]) -> Vec<u8> {
        self.int8(v)
            .into_iter()
            .map(|q| (i16::from(q) + 128) as u8)
            .collect()
    }

    /// The vector an int8 code stands for.
    pub fn dequantize(self, q: &[i8]) -> Vec<f32> {
        let k = f64::from(self.range) / 127.0;
        q.iter().map(|c| (f64::from(*c) * k) as f32).collect()
    }
}

/// The sign bits, eight to a byte, most significant first; the last byte zero-padded.
pub fn ubinary(v: &[f32]) -> Vec<u8> {
    v.chunks(8)
        .map(|chunk| {
            chunk
                .iter()
                .enumerate()
                .fold(0u8, |byte, (k, x)| byte | (u8::from(*x > 0.0) << (7 - k)))
        })
        .collect()
}

/// [`ubinary`]'s bytes offset by −128.
pub fn binary(v: &[f32]) -> Vec<i8> {
    ubinary(v).into_iter().map(|u| (u ^ 0x80) as i8).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_bits_pack_most_significant_first_and_pad_the_last_byte_with_zeros() {
        // 12 values: the first byte 1011_0001, the second 0110 padded to 0110_0000.
        let v = [
            0.5, -0.1, 0.2, 0.3, 0.0, -0.0, -1.0, 0.9, //
            -0.2, 0.1, 0.4, -0.3,
        ];
        assert_eq!(ubinary(&v), vec![0b1011_0001, 0b0110_0000]);
        assert_eq!(binary(&v), vec![49, -32]);
        assert_eq!(ubinary(&[]), Vec::<u8>::new());
    }

    #[test]
    fn int8_rounds_half_away_from_zero_clamps_and_uint8_is_offset_by_128() {
        let s = Int8Scale { range: 0.5 };
        // × 254: 0.25 → 63.5 → 64; −0.25 → −64; 0.6 → 152.4 → 127; −0.6 → −128.
        let v = [0.25, -0.25, 0.6, -0.6, 0.0, 0.1];
        assert_eq!(s.int8(&v), vec![64, -64, 127, -128, 0, 25]);
        assert_eq!(s.uint8(&v), vec![192, 64, 255, 0, 128, 153]);
        let back = s.dequantize(&s.int8(&[0.1, -0.3]));
        assert!((back[0] - 0.1).abs() < 0.5 / 127.0, "{back:?}");
        assert!((back[1] + 0.3).abs() < 0.5 / 127.0, "{back:?}");
    }

    #[test]
    fn the_scale_is_the_fingerprints_largest_component_as_served_at_the_width_with_a_margin() {
        // Unit vectors: cut to 2 and renormalised, (0.6, 0.8, 0) stays, (0.1, 0.1, ~0.99)
        // becomes (0.707, 0.707): the largest is 0.8 → r = min(1, 1.2) = 1.
        let fp = vec![vec![0.6, 0.8, 0.0], vec![0.1, 0.1, (1.0f32 - 0.02).sqrt()]];
        assert_eq!(Int8Scale::from_fingerprint(&fp, 2).unwrap().range, 1.0);
        // At the full width nothing is renormalised: the largest is 0.99 → capped at 1.
        assert_eq!(Int8Scale::from_fingerprint(&fp, 3).unwrap().range, 1.0);
        // Small components: r = 1.5 × 0.2.
        let d = 25;
        let fp = vec![vec![0.2f32; d]];
        let r = Int8Scale::from_fingerprint(&fp, d).unwrap().range;
        assert!((r - 0.3).abs() < 1e-6, "{r}");
        // A model that does not normalise: its vectors as they are, no cap at 1.
        let fp = vec![vec![3.0, -4.0, 1.0]];
        assert_eq!(Int8Scale::from_fingerprint(&fp, 2).unwrap().range, 6.0);
        // Nothing at that width, or nothing but zeros: no scale.
        assert_eq!(Int8Scale::from_fingerprint(&fp, 4), None);
        assert_eq!(Int8Scale::from_fingerprint(&fp, 0), None);
        assert_eq!(Int8Scale::from_fingerprint(&[vec![0.0; 4]], 4), None);
    }

    #[test]
    fn embedding_types_parse_by_their_wire_names() {
        for t in EmbeddingType::ALL {
            assert_eq!(EmbeddingType::parse(t.as_str()), Some(t));
        }
        assert_eq!(EmbeddingType::parse("INT8"), None);
        assert!(EmbeddingType::Int8.needs_scale() && !EmbeddingType::Binary.needs_scale());
        assert!(EmbeddingType::Ubinary.is_quantized() && !EmbeddingType::Base64.is_quantized());
    }
}
