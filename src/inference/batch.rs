//! A batch as the model sees it: every token of every row **packed** into one `[tokens]`
//! sequence (no padding), with the indexes that map rows to token spans.
//!
//! Dense layers, norms and pooling run on the packed tokens, so padding costs nothing there.
//! Attention needs rows: on the CPU a packed kernel reads the tokens with the row lengths; elsewhere the batch also carries a [`PaddedLayout`] to gather tokens into
//! right-padded `[rows, longest]` for masked matmul attention and scatter them back.
//!
//! Built by the batcher thread while the model thread runs the previous batch, so the host work
//! and the host-to-device copies overlap with compute.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

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
    /// The mode actually used on `device` in `dtype` (our packed kernel is the CPU's, in f32).
    pub fn resolve(self, device: &Device, dtype: DType) -> Self {
        match self {
            Self::Auto if device.is_cpu() && dtype == DType::F32 => Self::Packed,
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
    /// Present when some row continues a shared prefix: its keys are the prefix's, then its own.
    pub shared: Option<SharedKeys>,
}

/// Key rows for attention when rows continue shared prefixes (causal models only).
pub struct SharedKeys {
    /// Keys per row: prefix length + own length, at most.
    pub kv_longest: usize,
    /// For each key slot `[rows × kv_longest]`, the packed token it reads.
    pub kv_gather: Tensor,
    /// `[rows, 1, 1, 1]` prefix length of each row (0 without one), f32.
    pub prefix_len: Tensor,
    /// `[rows, 1, 1, 1]` own length of each row, f32.
    pub own_len: Tensor,
}

/// One input row: its own tokens and, for a causal model, the shared prefix it continues.
#[derive(Clone, Copy)]
pub struct RowInput<'a> {
    pub input: &'a TokenizedInput,
    pub prefix: Option<&'a Arc<Vec<u32>>>,
}

impl<'a> RowInput<'a> {
    pub fn plain(input: &'a TokenizedInput) -> Self {
        Self {
            input,
            prefix: None,
        }
    }
}

/// Tensors of one batch.
///
/// Rows `0..outputs` are the inputs, in order; rows after them are the distinct shared prefixes
/// those inputs continue, each computed once. Only input rows produce outputs.
pub struct PreparedBatch {
    /// `[tokens]` token ids, rows concatenated.
    pub input_ids: Tensor,
    /// `[tokens]` token type (segment) ids.
    pub type_ids: Tensor,
    /// `[tokens]` position of each token in its sequence (a row continuing a prefix starts at
    /// the prefix's length).
    pub positions: Tensor,
    /// `[tokens]` row of each token (u32), for segment sums.
    pub row_of_token: Tensor,
    /// `[outputs]` index of each input row's first token.
    pub first_token: Tensor,
    /// `[outputs]` index of each input row's last token.
    pub last_token: Tensor,
    /// Own token count of every row, prefix rows included.
    pub lengths: Vec<usize>,
    /// For every row, the prefix row it continues.
    pub prefix_of: Vec<Option<usize>>,
    /// Input rows (the rows that produce outputs).
    pub outputs: usize,
    /// Present when attention runs padded.
    pub padded: Option<PaddedLayout>,
}

impl PreparedBatch {
    /// Packs `rows` (and the distinct prefixes they continue) and uploads them; adds a padded
    /// layout when `mode` resolves to padded.
    pub fn build<'a>(
        rows: impl ExactSizeIterator<Item = RowInput<'a>>,
        device: &Device,
        mode: AttentionMode,
    ) -> Result<Self> {
        let rows: Vec<RowInput<'a>> = rows.collect();
        let outputs = rows.len();
        // Distinct prefixes (by identity), appended as rows after the inputs.
        let mut prefixes: Vec<&Arc<Vec<u32>>> = Vec::new();
        let mut prefix_of: Vec<Option<usize>> = Vec::with_capacity(outputs);
        for row in &rows {
            prefix_of.push(row.prefix.map(|p| {
                let k = match prefixes.iter().position(|q| Arc::ptr_eq(q, p)) {
                    Some(k) => k,
                    None => {
                        prefixes.push(p);
                        prefixes.len() - 1
                    }
                };
                outputs + k
            }));
        }
        prefix_of.extend(std::iter::repeat_n(None, prefixes.len()));
        // (ids, type ids, first position) of every row.
        let empty_types: Vec<Vec<u32>> = prefixes.iter().map(|p| vec![0; p.len()]).collect();
        let mut all: Vec<(&[u32], &[u32], usize)> = rows
            .iter()
            .map(|r| {
                let start = r.prefix.map_or(0, |p| p.len());
                (r.input.ids.as_slice(), r.input.type_ids.as_slice(), start)
            })
            .collect();
        all.extend(
            prefixes
                .iter()
                .zip(&empty_types)
                .map(|(p, t)| (p.as_slice(), t.as_slice(), 0)),
        );
        let total: usize = all.iter().map(|r| r.0.len()).sum();
        let longest = all.iter().map(|r| r.0.len()).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(total);
        let mut types = Vec::with_capacity(total);
        let mut positions = Vec::with_capacity(total);
        let mut row_of_token = Vec::with_capacity(total);
        let mut starts = Vec::with_capacity(all.len());
        let mut lengths = Vec::with_capacity(all.len());
        for (row, (row_ids, row_types, first_pos)) in all.iter().enumerate() {
            if row_ids.is_empty() {
                candle_core::bail!("row {row} has no tokens");
            }
            starts.push(ids.len());
            ids.extend_from_slice(row_ids);
            types.extend_from_slice(row_types);
            positions.extend((*first_pos..first_pos + row_ids.len()).map(|p| p as u32));
            row_of_token.extend(std::iter::repeat_n(row as u32, row_ids.len()));
            lengths.push(row_ids.len());
        }
        let first: Vec<u32> = starts[..outputs].iter().map(|&s| s as u32).collect();
        let last: Vec<u32> = (0..outputs)
            .map(|r| (starts[r] + lengths[r] - 1) as u32)
            .collect();
        // The engine resolved the mode for its device and dtype already; `Auto` here (a test
        // building a batch directly) means the f32 choice.
        let padded = match mode.resolve(device, DType::F32) {
            AttentionMode::Padded => Some(padded_layout(
                &starts, &lengths, &prefix_of, longest, total, device,
            )?),
            _ => None,
        };
        Ok(Self {
            input_ids: Tensor::from_vec(ids, total, device)?,
            type_ids: Tensor::from_vec(types, total, device)?,
            positions: Tensor::from_vec(positions, total, device)?,
            row_of_token: Tensor::from_vec(row_of_token, total, device)?,
            first_token: Tensor::from_vec(first, outputs, device)?,
            last_token: Tensor::from_vec(last, outputs, device)?,
            lengths,
            prefix_of,
            outputs,
            padded,
        })
    }

    /// Whether any row continues a shared prefix.
    pub fn has_prefixes(&self) -> bool {
        self.prefix_of.iter().any(Option::is_some)
    }

    /// First packed token of each row.
    pub fn starts(&self) -> Vec<usize> {
        let mut acc = 0;
        self.lengths
            .iter()
            .map(|&l| {
                let s = acc;
                acc += l;
                s
            })
            .collect()
    }

    /// All rows, prefix rows included.
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

/// Gather/scatter indexes for padded attention; key indexes too when rows continue prefixes.
fn padded_layout(
    starts: &[usize],
    lengths: &[usize],
    prefix_of: &[Option<usize>],
    longest: usize,
    total: usize,
    device: &Device,
) -> Result<PaddedLayout> {
    let rows = lengths.len();
    let mut gather = Vec::with_capacity(rows * longest);
    let mut scatter = Vec::with_capacity(total);
    let mut mask = Vec::with_capacity(rows * longest);
    for (row, &len) in lengths.iter().enumerate() {
        let start = starts[row] as u32;
        for pos in 0..longest {
            let real = pos < len;
            gather.push(if real { start + pos as u32 } else { start });
            mask.push(real as u32);
        }
        scatter.extend((0..len).map(|pos| (row * longest + pos) as u32));
    }
    let shared = if prefix_of.iter().any(Option::is_some) {
        let plen = |r: usize| prefix_of[r].map_or(0, |p| lengths[p]);
        let kv_longest = (0..rows).map(|r| plen(r) + lengths[r]).max().unwrap_or(0);
        let mut kv = Vec::with_capacity(rows * kv_longest);
        for r in 0..rows {
            let p = prefix_of[r].map(|p| (starts[p], lengths[p]));
            let keys = p
                .iter()
                .flat_map(|&(s, l)| s..s + l)
                .chain(starts[r]..starts[r] + lengths[r]);
            let n = plen(r) + lengths[r];
            kv.extend(keys.map(|t| t as u32));
            kv.extend(std::iter::repeat_n(starts[r] as u32, kv_longest - n));
        }
        let col = |f: &dyn Fn(usize) -> usize| -> Result<Tensor> {
            let v: Vec<f32> = (0..rows).map(|r| f(r) as f32).collect();
            Tensor::from_vec(v, (rows, 1, 1, 1), device)
        };
        Some(SharedKeys {
            kv_longest,
            kv_gather: Tensor::from_vec(kv, rows * kv_longest, device)?,
            prefix_len: col(&plen)?,
            own_len: col(&|r| lengths[r])?,
        })
    } else {
        None
    };
    Ok(PaddedLayout {
        longest,
        gather: Tensor::from_vec(gather, rows * longest, device)?,
        scatter: Tensor::from_vec(scatter, total, device)?,
        mask: Tensor::from_vec(mask, (rows, longest), device)?,
        shared,
    })
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
        let b = PreparedBatch::build(
            inputs.iter().map(RowInput::plain),
            &Device::Cpu,
            AttentionMode::Padded,
        )?;
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
        let packed = PreparedBatch::build(
            inputs.iter().map(RowInput::plain),
            &Device::Cpu,
            AttentionMode::Auto,
        )?;
        assert!(packed.padded.is_none());
        assert_eq!(packed.attended_tokens(), 6);
        Ok(())
    }

    #[test]
    fn shared_prefixes_run_once_per_batch() -> Result<()> {
        let prefix = Arc::new(vec![7u32, 8, 9]);
        let other = Arc::new(vec![5u32]);
        let tails = [input(&[1, 2]), input(&[3]), input(&[4])];
        let rows = [
            RowInput {
                input: &tails[0],
                prefix: Some(&prefix),
            },
            RowInput {
                input: &tails[1],
                prefix: Some(&other),
            },
            RowInput {
                input: &tails[2],
                prefix: Some(&prefix),
            },
        ];
        let b = PreparedBatch::build(rows.into_iter(), &Device::Cpu, AttentionMode::Padded)?;
        // Inputs first, then each distinct prefix once.
        assert_eq!(b.input_ids.to_vec1::<u32>()?, [1, 2, 3, 4, 7, 8, 9, 5]);
        assert_eq!(b.positions.to_vec1::<u32>()?, [3, 4, 1, 3, 0, 1, 2, 0]);
        assert_eq!(b.prefix_of, [Some(3), Some(4), Some(3), None, None]);
        assert_eq!(b.outputs, 3);
        assert_eq!(b.last_token.to_vec1::<u32>()?, [1, 2, 3]);
        let shared = b.padded.as_ref().unwrap().shared.as_ref().unwrap();
        assert_eq!(shared.kv_longest, 5);
        // Row 0's keys: the prefix tokens (packed 4..7), then its own (0..2).
        assert_eq!(&shared.kv_gather.to_vec1::<u32>()?[..5], [4, 5, 6, 0, 1]);
        Ok(())
    }
}
