//! From token states to one vector per input: pooling on the device, then MRL truncation and
//! L2 normalisation on the host.
//!
//! Token states arrive packed (`[tokens, h]`, rows concatenated, see [`PreparedBatch`]), so
//! pooling is index work: the first or last token of each row, or a segment mean.

use candle_core::{DType, Result, Tensor};

use super::batch::PreparedBatch;
use crate::model_spec::Pooling;

/// Pools packed `[tokens, h]` states into `[rows, h]` (f32).
pub fn pool(hidden: &Tensor, batch: &PreparedBatch, pooling: Pooling) -> Result<Tensor> {
    if batch.has_prefixes() {
        candle_core::bail!("pooling runs on whole rows; shared prefixes are for rerankers only");
    }
    let hidden = hidden.to_dtype(DType::F32)?;
    match pooling {
        Pooling::Cls => hidden.index_select(&batch.first_token, 0),
        Pooling::Last => hidden.index_select(&batch.last_token, 0),
        Pooling::Mean => {
            let (rows, h) = (batch.rows(), hidden.dim(1)?);
            let sums = Tensor::zeros((rows, h), DType::F32, hidden.device())?.index_add(
                &batch.row_of_token,
                &hidden,
                0,
            )?;
            let counts: Vec<f32> = batch.lengths.iter().map(|&l| l as f32).collect();
            let counts = Tensor::from_vec(counts, (rows, 1), hidden.device())?;
            sums.broadcast_div(&counts)
        }
    }
}

/// Truncates to `dims` (Matryoshka) and, when `normalize`, rescales to unit L2 norm.
///
/// Normalising after truncation is what makes a truncated vector usable with cosine or dot
/// product: the prefix of a unit vector is not a unit vector.
pub fn finish(mut v: Vec<f32>, dims: Option<usize>, normalize: bool) -> Vec<f32> {
    if let Some(d) = dims {
        v.truncate(d);
    }
    if normalize {
        let norm = v
            .iter()
            .map(|x| (*x as f64) * (*x as f64))
            .sum::<f64>()
            .sqrt();
        // The same floor as torch.nn.functional.normalize, so a zero vector stays zero.
        let scale = 1.0 / norm.max(1e-12);
        for x in &mut v {
            *x = (*x as f64 * scale) as f32;
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inference::batch::AttentionMode;
    use crate::inference::tokenize::TokenizedInput;
    use candle_core::Device;

    #[test]
    fn pooling_over_packed_rows() -> Result<()> {
        let dev = Device::Cpu;
        let input = |n: usize| TokenizedInput {
            ids: vec![0; n],
            type_ids: vec![0; n],
        };
        let inputs = [input(3), input(2)];
        let batch = PreparedBatch::build(
            inputs.iter().map(crate::inference::batch::RowInput::plain),
            &dev,
            AttentionMode::Packed,
        )?;
        // Five packed tokens, h = 2: row 0 is tokens 0..3, row 1 tokens 3..5.
        let hidden = Tensor::new(
            &[[1f32, 2.], [3., 4.], [5., 6.], [10., 20.], [30., 40.]],
            &dev,
        )?;
        let mean = pool(&hidden, &batch, Pooling::Mean)?.to_vec2::<f32>()?;
        assert_eq!(mean, [[3., 4.], [20., 30.]]);
        let cls = pool(&hidden, &batch, Pooling::Cls)?.to_vec2::<f32>()?;
        assert_eq!(cls, [[1., 2.], [10., 20.]]);
        let last = pool(&hidden, &batch, Pooling::Last)?.to_vec2::<f32>()?;
        assert_eq!(last, [[5., 6.], [30., 40.]]);
        Ok(())
    }

    #[test]
    fn truncation_renormalises() {
        let v = finish(vec![3., 4., 12.], Some(2), true);
        assert!((v[0] - 0.6).abs() < 1e-7 && (v[1] - 0.8).abs() < 1e-7);
        assert_eq!(finish(vec![3., 4., 12.], Some(2), false), [3., 4.]);
        assert_eq!(finish(vec![0., 0.], None, true), [0., 0.]);
    }
}
