//! From token states to one vector per input: pooling on the device, then MRL truncation and
//! L2 normalisation on the host.
//!
//! Batches are right-padded, so the mask says which positions are real and `lengths[i] - 1` is
//! the last real token of row `i`.

use candle_core::{DType, IndexOp, Result, Tensor};

use crate::model_spec::Pooling;

/// Pools `[b, s, h]` token states into `[b, h]` (f32).
pub fn pool(hidden: &Tensor, mask: &Tensor, lengths: &[usize], pooling: Pooling) -> Result<Tensor> {
    let hidden = hidden.to_dtype(DType::F32)?;
    match pooling {
        Pooling::Cls => hidden.i((.., 0))?.contiguous(),
        Pooling::Mean => {
            let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?; // [b, s, 1]
            let summed = hidden.broadcast_mul(&mask)?.sum(1)?; // [b, h]
            let counts = mask.sum(1)?; // [b, 1]
            summed.broadcast_div(&counts)
        }
        Pooling::Last => {
            let rows = lengths
                .iter()
                .enumerate()
                .map(|(i, &len)| hidden.i((i, len - 1)))
                .collect::<Result<Vec<_>>>()?;
            Tensor::stack(&rows, 0)
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
    use candle_core::Device;

    #[test]
    fn pooling_respects_padding() -> Result<()> {
        let dev = Device::Cpu;
        // Two rows, three positions, h = 2; row 1 has one padding position holding garbage.
        let hidden = Tensor::new(
            &[
                [[1f32, 2.], [3., 4.], [5., 6.]],
                [[10., 20.], [30., 40.], [999., 999.]],
            ],
            &dev,
        )?;
        let mask = Tensor::new(&[[1u32, 1, 1], [1, 1, 0]], &dev)?;
        let lengths = [3, 2];
        let mean = pool(&hidden, &mask, &lengths, Pooling::Mean)?.to_vec2::<f32>()?;
        assert_eq!(mean, [[3., 4.], [20., 30.]]);
        let cls = pool(&hidden, &mask, &lengths, Pooling::Cls)?.to_vec2::<f32>()?;
        assert_eq!(cls, [[1., 2.], [10., 20.]]);
        let last = pool(&hidden, &mask, &lengths, Pooling::Last)?.to_vec2::<f32>()?;
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
