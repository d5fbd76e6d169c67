//! A batch as the model sees it: right-padded id, type-id and mask tensors on the device.
//!
//! Built by the batcher thread while the model thread runs the previous batch, so the host-side
//! padding and the host-to-device copy overlap with compute.

use candle_core::{Device, Result, Tensor};

use super::tokenize::TokenizedInput;

/// Tensors of one batch, `[rows, longest]` each.
pub struct PreparedBatch {
    pub input_ids: Tensor,
    pub type_ids: Tensor,
    /// 1 for a real token, 0 for padding (u32).
    pub mask: Tensor,
    /// Real length of each row.
    pub lengths: Vec<usize>,
}

impl PreparedBatch {
    /// Pads `inputs` on the right with `pad_id` to the longest and uploads them.
    pub fn build<'a>(
        inputs: impl ExactSizeIterator<Item = &'a TokenizedInput>,
        pad_id: u32,
        device: &Device,
    ) -> Result<Self> {
        let inputs: Vec<&TokenizedInput> = inputs.collect();
        let rows = inputs.len();
        let longest = inputs.iter().map(|i| i.len()).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(rows * longest);
        let mut types = Vec::with_capacity(rows * longest);
        let mut mask = Vec::with_capacity(rows * longest);
        let mut lengths = Vec::with_capacity(rows);
        for input in inputs {
            let pad = longest - input.len();
            ids.extend_from_slice(&input.ids);
            ids.extend(std::iter::repeat_n(pad_id, pad));
            types.extend_from_slice(&input.type_ids);
            types.extend(std::iter::repeat_n(0, pad));
            mask.extend(std::iter::repeat_n(1u32, input.len()));
            mask.extend(std::iter::repeat_n(0u32, pad));
            lengths.push(input.len());
        }
        Ok(Self {
            input_ids: Tensor::from_vec(ids, (rows, longest), device)?,
            type_ids: Tensor::from_vec(types, (rows, longest), device)?,
            mask: Tensor::from_vec(mask, (rows, longest), device)?,
            lengths,
        })
    }

    pub fn rows(&self) -> usize {
        self.lengths.len()
    }

    /// Padded tokens (rows × longest): what the batch costs.
    pub fn padded_tokens(&self) -> usize {
        self.input_ids.elem_count()
    }

    /// Real tokens.
    pub fn tokens(&self) -> usize {
        self.lengths.iter().sum()
    }
}
