//! A batch as the model sees it: every token of every row **packed** into one `[tokens]`
//! sequence (no padding), with the indexes that map rows to token spans.
//!
//! Dense layers, norms and pooling run on the packed tokens, so padding costs nothing there.
//! Attention needs rows: packed attention (`inference::attention`, on the CPU and, in bf16/f16,
//! on CUDA) reads the tokens with the row lengths, and on CUDA the batch carries the kernel's
//! [`RowTable`], uploaded once and read by every layer. Where the packed kernel does not run
//! (f32 on CUDA, a head dim it is not built for, a card older than sm_80) the batch carries a
//! [`PaddedLayout`] to gather tokens into right-padded `[rows, longest]` for masked matmul
//! attention and scatter them back.
//!
//! Built by the batcher thread while the model thread runs the previous batch. On CUDA every
//! index goes up in one copy from a pinned buffer on the batcher's own stream, and the batch
//! carries the event that copy completes at: the model thread's stream waits on it
//! ([`PreparedBatch::wait_uploaded`]), so the upload never queues behind the running batch.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

use super::attention::{self, RowTable};
use super::tokenize::TokenizedInput;

/// How attention sees a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AttentionMode {
    /// Packed wherever its kernel runs, padded elsewhere.
    #[default]
    Auto,
    /// Packed tokens and row lengths (`inference::attention`).
    Packed,
    /// Right-padded rows with an additive mask (candle's ops, any device).
    Padded,
}

impl AttentionMode {
    /// The mode used on `device` in `dtype` for heads of `head_dim`: `Auto` is packed where
    /// [`packed_runs`] says it runs, padded elsewhere (with the reason); `Packed` where it does
    /// not run is an error.
    pub fn resolve(
        self,
        device: &Device,
        dtype: DType,
        head_dim: usize,
    ) -> std::result::Result<(Self, Option<String>), String> {
        match (self, packed_runs(device, dtype, head_dim)) {
            (Self::Auto, Ok(())) | (Self::Packed, Ok(())) => Ok((Self::Packed, None)),
            (Self::Auto, Err(why)) => Ok((Self::Padded, Some(why))),
            (Self::Packed, Err(why)) => Err(format!("packed attention does not run here: {why}")),
            (Self::Padded, _) => Ok((Self::Padded, None)),
        }
    }

    /// The name logs, `hello` and status use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Packed => "packed",
            Self::Padded => "padded",
        }
    }
}

/// Whether packed attention runs on `device` in `dtype` for heads of `head_dim`: on the CPU
/// always (bf16 and f16 widened); on CUDA in bf16 and f16, for the head dims its kernel is built
/// for, on sm_80 or newer, where the kernel loads.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn packed_runs(
    device: &Device,
    dtype: DType,
    head_dim: usize,
) -> std::result::Result<(), String> {
    match device {
        Device::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            attention::cuda_supports(dtype, head_dim)?;
            let (major, minor) = super::cuda::compute_capability(dev).map_err(|e| e.to_string())?;
            if major < 8 {
                return Err(format!(
                    "the packed attention kernel needs sm_80 or newer; this card is sm_{major}{minor}"
                ));
            }
            let launch =
                attention::kernel_launch(dtype, head_dim, 1, 1).map_err(|e| e.to_string())?;
            super::cuda::function(dev, launch.module, &launch.kernel)
                .map(|_| ())
                .map_err(|e| format!("the packed attention kernel does not load: {e}"))
        }
        _ => Err(format!(
            "no packed attention kernel for {:?}",
            device.location()
        )),
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
    /// `[rows, 1, 1, 1]` prefix length of each row (0 without one), u32 (uploaded with the
    /// batch's other indexes, so the model's stream waits for them too).
    pub prefix_len: Tensor,
    /// `[rows, 1, 1, 1]` own length of each row, u32.
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
    /// The packed kernel's row table, on a CUDA device when attention runs packed.
    pub row_table: Option<RowTable>,
    /// Present when attention runs padded.
    pub padded: Option<PaddedLayout>,
    /// Where the batch's upload completes on the batcher's stream (CUDA only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    uploaded: Option<UploadDone>,
}

/// The u32 arrays of a batch, on their way to the device in one upload.
#[derive(Default)]
struct Uploads<'a> {
    parts: Vec<(&'a [u32], Vec<usize>)>,
}

impl<'a> Uploads<'a> {
    fn add(&mut self, data: &'a [u32], shape: &[usize]) -> usize {
        self.parts.push((data, shape.to_vec()));
        self.parts.len() - 1
    }

    /// One tensor per part, and (on CUDA) the event the copy completes at.
    fn send(self, device: &Device) -> Result<(Vec<Tensor>, Option<UploadDone>)> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => {
                let slices: Vec<&[u32]> = self.parts.iter().map(|(d, _)| *d).collect();
                let (flat, event) = super::cuda::upload_u32(dev, &slices)?;
                let tensors = flat
                    .into_iter()
                    .zip(&self.parts)
                    .map(|(t, (_, shape))| t.reshape(shape.as_slice()))
                    .collect::<Result<Vec<_>>>()?;
                Ok((tensors, Some(event)))
            }
            _ => {
                let tensors = self
                    .parts
                    .iter()
                    .map(|(d, shape)| Tensor::from_slice(d, shape.as_slice(), device))
                    .collect::<Result<Vec<_>>>()?;
                Ok((tensors, None))
            }
        }
    }
}

/// The event a CUDA upload completes at (no value exists without the `cuda` feature).
#[cfg(feature = "cuda")]
type UploadDone = Arc<candle_core::cuda_backend::cudarc::driver::CudaEvent>;
#[cfg(not(feature = "cuda"))]
type UploadDone = std::convert::Infallible;

impl PreparedBatch {
    /// Packs `rows` (and the distinct prefixes they continue) and uploads them; adds the row
    /// table when attention runs packed on CUDA, a padded layout when it runs padded. `Auto`
    /// (a batch built outside an engine) is packed on the CPU, padded elsewhere.
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
        if u32::try_from(total).is_err() {
            candle_core::bail!("a batch of {total} tokens is past u32 indexes");
        }
        let first: Vec<u32> = starts[..outputs].iter().map(|&s| s as u32).collect();
        let last: Vec<u32> = (0..outputs)
            .map(|r| (starts[r] + lengths[r] - 1) as u32)
            .collect();
        let mode = match mode {
            AttentionMode::Auto if device.is_cpu() => AttentionMode::Packed,
            AttentionMode::Auto => AttentionMode::Padded,
            other => other,
        };
        let table = match mode {
            AttentionMode::Packed if !device.is_cpu() => {
                Some(RowTable::host(&lengths, &prefix_of)?)
            }
            _ => None,
        };
        let padded = match mode {
            AttentionMode::Padded => Some(padded_indexes(
                &starts, &lengths, &prefix_of, longest, total,
            )),
            _ => None,
        };
        let mut up = Uploads::default();
        let at = [
            up.add(&ids, &[total]),
            up.add(&types, &[total]),
            up.add(&positions, &[total]),
            up.add(&row_of_token, &[total]),
            up.add(&first, &[outputs]),
            up.add(&last, &[outputs]),
        ];
        let table_at = table
            .as_ref()
            .map(|(r, t)| (up.add(r, &[r.len()]), up.add(t, &[t.len()]), t.len() / 2));
        let padded_at = padded.as_ref().map(|p| {
            let rows = lengths.len();
            (
                up.add(&p.gather, &[rows * longest]),
                up.add(&p.scatter, &[total]),
                up.add(&p.mask, &[rows, longest]),
                p.kv_gather.as_ref().map(|(kv, kv_longest)| {
                    (
                        up.add(kv, &[rows * kv_longest]),
                        up.add(&p.prefix_len, &[rows, 1, 1, 1]),
                        up.add(&p.own_len, &[rows, 1, 1, 1]),
                    )
                }),
            )
        });
        let (tensors, ready) = up.send(device)?;
        let take = |i: usize| tensors[i].clone();
        let row_table = table_at.map(|(r, t, n_tiles)| RowTable {
            rows: take(r),
            tiles: take(t),
            n_tiles,
        });
        let padded = match (padded, padded_at) {
            (Some(p), Some((gather, scatter, mask, kv))) => Some(PaddedLayout {
                longest,
                gather: take(gather),
                scatter: take(scatter),
                mask: take(mask),
                shared: match (&p.kv_gather, kv) {
                    (Some((_, kv_longest)), Some((kv, prefix_len, own_len))) => Some(SharedKeys {
                        kv_longest: *kv_longest,
                        kv_gather: take(kv),
                        prefix_len: take(prefix_len),
                        own_len: take(own_len),
                    }),
                    _ => None,
                },
            }),
            _ => None,
        };
        Ok(Self {
            input_ids: take(at[0]),
            type_ids: take(at[1]),
            positions: take(at[2]),
            row_of_token: take(at[3]),
            first_token: take(at[4]),
            last_token: take(at[5]),
            lengths,
            prefix_of,
            outputs,
            row_table,
            padded,
            uploaded: ready,
        })
    }

    /// Makes this thread's stream wait for the batch's upload (on CUDA; a no-op elsewhere).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn wait_uploaded(&self, device: &Device) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let (Device::Cuda(dev), Some(event)) = (device, &self.uploaded) {
            super::cuda::wait(dev, event)?;
        }
        Ok(())
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

    /// The packed attention op for this batch's rows (its row table on CUDA).
    pub fn attention(
        &self,
        (q_heads, kv_heads, head_dim): (usize, usize, usize),
        scale: f32,
        causal: bool,
    ) -> attention::PackedAttention {
        attention::PackedAttention {
            lengths: self.lengths.clone(),
            prefix_of: self.prefix_of.clone(),
            q_heads,
            kv_heads,
            head_dim,
            scale,
            causal,
            table: self.row_table.clone(),
        }
    }
}

/// A padded layout's indexes on the host.
struct PaddedIndexes {
    gather: Vec<u32>,
    scatter: Vec<u32>,
    mask: Vec<u32>,
    /// Key indexes and their width, when rows continue prefixes.
    kv_gather: Option<(Vec<u32>, usize)>,
    prefix_len: Vec<u32>,
    own_len: Vec<u32>,
}

/// Gather/scatter indexes for padded attention; key indexes too when rows continue prefixes.
fn padded_indexes(
    starts: &[usize],
    lengths: &[usize],
    prefix_of: &[Option<usize>],
    longest: usize,
    total: usize,
) -> PaddedIndexes {
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
    let plen = |r: usize| prefix_of[r].map_or(0, |p| lengths[p]);
    let kv_gather = prefix_of.iter().any(Option::is_some).then(|| {
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
        (kv, kv_longest)
    });
    PaddedIndexes {
        gather,
        scatter,
        mask,
        kv_gather,
        prefix_len: (0..rows).map(|r| plen(r) as u32).collect(),
        own_len: lengths.iter().map(|&l| l as u32).collect(),
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
