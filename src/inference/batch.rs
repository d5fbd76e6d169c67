//! A batch as the model sees it: every token of every row **packed** into one `[tokens]`
//! sequence (no padding), with the indexes that map rows to token spans.
//!
//! Dense layers, norms and pooling run on the packed tokens, so padding costs nothing there.
//! Attention needs rows: on the CPU a packed kernel reads the tokens with the row lengths; elsewhere the batch also carries a [`PaddedLayout`] to gather tokens into
//! right-padded `[rows, longest]` for masked matmul attention and scatter them back.
//!
//! Built by the batcher thread while the model thread runs the previous batch, so the host work
//! and the host-to-device copies overlap with compute.

use candle_core::{Device, Result, Tensor};

use super::tokenize::TokenizedInput;

/// How attention sees a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AttentionMode {
    /// Packed on the CPU (our packed kernel), padded elsewhere.
    #[default]
    Auto,
    /// Packed tokens and row lengths (the CPU kernel).
    Packed,
    /// Right-padded rows with an additive mask (any device).
    Padded,
}

impl AttentionMode {
    /// The mode actually used on `device`.
    pub fn resolve(self, device: &Device) -> Self {
        match self {
            Self::Auto if device.is_cpu() => Self::Packed,
            Self::Auto => Self::Padded,
            other => other,
        }
    }
}

/// Gather/scatter indexes between packed tokens and right-padded rows.
pub struct PaddedLayout {
    /// Longest row (the padded width).
    pub longest: usize,
    /// For each padded slot `[rows × longest]`, the packed token it holds (padding slots hold
    /// their row's first token; the mask hides them).
    pub gather: Tensor,
    /// For each packed token, its padded slot.
    pub scatter: Tensor,
    /// `[rows, longest]`: 1 for a token, 0 for padding (u32).
    pub mask: Tensor,
}

/// Tensors of one batch.
pub struct PreparedBatch {
    /// `[tokens]` token ids, rows concatenated.
    pub input_ids: Tensor,
    /// `[tokens]` token type (segment) ids.
    pub type_ids: Tensor,
    /// `[tokens]` position of each token within its row.
    pub positions: Tensor,
    /// `[tokens]` row of each token (u32), for segment sums.
    pub row_of_token: Tensor,
    /// `[rows]` index of each row's first token.
    pub first_token: Tensor,
    /// `[rows]` index of each row's last token.
    pub last_token: Tensor,
    /// Real length of each row.
    pub lengths: Vec<usize>,
    /// Present when attention runs padded.
    pub padded: Option<PaddedLayout>,
}

impl PreparedBatch {
    /// Packs `inputs` and uploads them; adds a padded layout when `mode` resolves to padded.
    pub fn build<'a>(
        inputs: impl ExactSizeIterator<Item = &'a TokenizedInput>,
        device: &Device,
        mode: AttentionMode,
    ) -> Result<Self> {
        let inputs: Vec<&TokenizedInput> = inputs.collect();
        let rows = inputs.len();
        let total: usize = inputs.iter().map(|i| i.len()).sum();
        let longest = inputs.iter().map(|i| i.len()).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(total);
        let mut types = Vec::with_capacity(total);
        let mut positions = Vec::with_capacity(total);
        let mut row_of_token = Vec::with_capacity(total);
        let mut first = Vec::with_capacity(rows);
        let mut last = Vec::with_capacity(rows);
        let mut lengths = Vec::with_capacity(rows);
        for (row, input) in inputs.iter().enumerate() {
            if input.is_empty() {
                candle_core::bail!("row {row} has no tokens");
            }
            first.push(ids.len() as u32);
            ids.extend_from_slice(&input.ids);
            types.extend_from_slice(&input.type_ids);
            positions.extend(0..input.len() as u32);
            row_of_token.extend(std::iter::repeat_n(row as u32, input.len()));
            last.push(ids.len() as u32 - 1);
            lengths.push(input.len());
        }
        let padded = match mode.resolve(device) {
            AttentionMode::Padded => {
                let mut gather = Vec::with_capacity(rows * longest);
                let mut scatter = Vec::with_capacity(total);
                let mut mask = Vec::with_capacity(rows * longest);
                for (row, &len) in lengths.iter().enumerate() {
                    let start = first[row];
                    for pos in 0..longest {
                        let real = pos < len;
                        gather.push(if real { start + pos as u32 } else { start });
                        mask.push(real as u32);
                    }
                    scatter.extend((0..len).map(|pos| (row * longest + pos) as u32));
                }
                Some(PaddedLayout {
                    longest,
                    gather: Tensor::from_vec(gather, rows * longest, device)?,
                    scatter: Tensor::from_vec(scatter, total, device)?,
                    mask: Tensor::from_vec(mask, (rows, longest), device)?,
                })
            }
            _ => None,
        };
        Ok(Self {
            input_ids: Tensor::from_vec(ids, total, device)?,
            type_ids: Tensor::from_vec(types, total, device)?,
            positions: Tensor::from_vec(positions, total, device)?,
            row_of_token: Tensor::from_vec(row_of_token, total, device)?,
            first_token: Tensor::from_vec(first, rows, device)?,
            last_token: Tensor::from_vec(last, rows, device)?,
            lengths,
            padded,
        })
    }

    pub fn rows(&self) -> usize {
        self.lengths.len()
    }

    /// Real tokens.
    pub fn tokens(&self) -> usize {
        self.lengths.iter().sum()
    }

    /// Tokens attention pays for: padded rows × longest, or the real tokens when packed.
    pub fn attended_tokens(&self) -> usize {
        match &self.padded {
            Some(p) => p.longest * self.rows(),
            None => self.tokens(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(ids: &[u32]) -> TokenizedInput {
        TokenizedInput {
            ids: ids.to_vec(),
            type_ids: vec![0; ids.len()],
        }
    }

    #[test]
    fn packs_rows_and_maps_padding() -> Result<()> {
        let inputs = [input(&[1, 2, 3]), input(&[4]), input(&[5, 6])];
        let b = PreparedBatch::build(inputs.iter(), &Device::Cpu, AttentionMode::Padded)?;
        assert_eq!(b.input_ids.to_vec1::<u32>()?, [1, 2, 3, 4, 5, 6]);
        assert_eq!(b.positions.to_vec1::<u32>()?, [0, 1, 2, 0, 0, 1]);
        assert_eq!(b.row_of_token.to_vec1::<u32>()?, [0, 0, 0, 1, 2, 2]);
        assert_eq!(b.first_token.to_vec1::<u32>()?, [0, 3, 4]);
        assert_eq!(b.last_token.to_vec1::<u32>()?, [2, 3, 5]);
        let p = b.padded.as_ref().unwrap();
        assert_eq!(p.longest, 3);
        assert_eq!(p.gather.to_vec1::<u32>()?, [0, 1, 2, 3, 3, 3, 4, 5, 4]);
        assert_eq!(p.scatter.to_vec1::<u32>()?, [0, 1, 2, 3, 6, 7]);
        assert_eq!(p.mask.to_vec2::<u32>()?, [[1, 1, 1], [1, 0, 0], [1, 1, 0]]);
        assert_eq!((b.tokens(), b.attended_tokens()), (6, 9));
        let packed = PreparedBatch::build(inputs.iter(), &Device::Cpu, AttentionMode::Auto)?;
        assert!(packed.padded.is_none());
        assert_eq!(packed.attended_tokens(), 6);
        Ok(())
    }
}
