//! Turning request text into token ids, off the model thread.
//!
//! Truncation goes through the tokenizer itself (never by slicing ids afterwards), so the
//! special tokens a model pools on (`[CLS]`, Qwen3's appended `<|endoftext|>`) always survive.
//! Pairs (reranking) truncate the longest side first, as transformers does. With
//! [`Truncation::Refuse`] an input that would be cut is an error naming it instead.

use std::path::Path;

use tokenizers::{
    EncodeInput, Encoding, Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy,
};

/// What happens to inputs longer than the model's max tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Truncation {
    /// Cut to the max (the norm for embedding and reranking).
    #[default]
    Truncate,
    /// Refuse the input with an error.
    Refuse,
}

/// Token ids of one input, ready for the batcher.
#[derive(Clone, Debug)]
pub struct TokenizedInput {
    pub ids: Vec<u32>,
    pub type_ids: Vec<u32>,
}

impl TokenizedInput {
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Why an input could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("cannot load tokenizer {path}: {message}")]
    Load { path: String, message: String },
    #[error("tokenizer failed: {0}")]
    Encode(String),
    #[error("input {index} is longer than the model's {max} tokens (truncation is off)")]
    TooLong { index: usize, max: usize },
}

/// A tokenizer configured for one model: truncation at `max_tokens`, no padding.
pub struct InputTokenizer {
    tokenizer: Tokenizer,
    max_tokens: usize,
    truncation: Truncation,
}

/// An encoding as an input, or the error of one that was cut where truncation is refused.
fn accept(
    index: usize,
    enc: Encoding,
    truncation: Truncation,
    max_tokens: usize,
) -> Result<TokenizedInput, TokenizeError> {
    if truncation == Truncation::Refuse && !enc.get_overflowing().is_empty() {
        return Err(TokenizeError::TooLong {
            index,
            max: max_tokens,
        });
    }
    Ok(TokenizedInput {
        ids: enc.get_ids().to_vec(),
        type_ids: enc.get_type_ids().to_vec(),
    })
}

impl InputTokenizer {
    pub fn load(
        path: &Path,
        max_tokens: usize,
        truncation: Truncation,
    ) -> Result<Self, TokenizeError> {
        let load_err = |message: String| TokenizeError::Load {
            path: path.display().to_string(),
            message,
        };
        let mut tokenizer = Tokenizer::from_file(path).map_err(|e| load_err(e.to_string()))?;
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: max_tokens,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(|e| load_err(e.to_string()))?;
        Ok(Self {
            tokenizer,
            max_tokens,
            truncation,
        })
    }

    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The id of a token string, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Tokenizes single texts.
    pub fn encode_texts(&self, texts: Vec<String>) -> Result<Vec<TokenizedInput>, TokenizeError> {
        let inputs: Vec<EncodeInput> = texts.into_iter().map(EncodeInput::from).collect();
        self.encode(inputs, self.truncation)
    }

    /// Tokenizes single texts, cutting what is too long even where this tokenizer refuses it
    /// (the gate's probe texts: every provider of a space must read them identically, and a
    /// truncating one cuts them at the model's limit).
    pub fn encode_texts_truncated(
        &self,
        texts: Vec<String>,
    ) -> Result<Vec<TokenizedInput>, TokenizeError> {
        let inputs: Vec<EncodeInput> = texts.into_iter().map(EncodeInput::from).collect();
        self.encode(inputs, Truncation::Truncate)
    }

    /// Tokenizes (query, document) pairs.
    pub fn encode_pairs(
        &self,
        query: &str,
        documents: Vec<String>,
    ) -> Result<Vec<TokenizedInput>, TokenizeError> {
        let inputs: Vec<EncodeInput> = documents
            .into_iter()
            .map(|d| EncodeInput::from((query.to_string(), d)))
            .collect();
        self.encode(inputs, self.truncation)
    }

    /// Tokenizes `text` as is: no special tokens added, no truncation (for fixed template parts).
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let enc = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        for o in enc.get_overflowing() {
            ids.extend_from_slice(o.get_ids());
        }
        Ok(ids)
    }

    /// Tokenizes `bodies` without special tokens, cuts each to what fits between `prefix` and
    /// `suffix` within the max tokens, and frames it: `prefix + body + suffix` (Qwen3-Reranker's
    /// chat template; the body is what gets truncated, never the template).
    pub fn encode_framed(
        &self,
        prefix: &[u32],
        bodies: Vec<String>,
        suffix: &[u32],
    ) -> Result<Vec<TokenizedInput>, TokenizeError> {
        let room = self.max_tokens.saturating_sub(prefix.len() + suffix.len());
        if room == 0 {
            return Err(TokenizeError::Encode(format!(
                "the prompt template alone takes {} of the {} tokens",
                prefix.len() + suffix.len(),
                self.max_tokens
            )));
        }
        let inputs: Vec<EncodeInput> = bodies.into_iter().map(EncodeInput::from).collect();
        let encodings = self
            .tokenizer
            .encode_batch(inputs, false)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        encodings
            .into_iter()
            .enumerate()
            .map(|(index, enc)| {
                let overflow = !enc.get_overflowing().is_empty();
                let body = enc.get_ids();
                if (overflow || body.len() > room) && self.truncation == Truncation::Refuse {
                    return Err(TokenizeError::TooLong {
                        index,
                        max: self.max_tokens,
                    });
                }
                let body = &body[..body.len().min(room)];
                let ids: Vec<u32> = [prefix, body, suffix].concat();
                let type_ids = vec![0; ids.len()];
                Ok(TokenizedInput { ids, type_ids })
            })
            .collect()
    }

    fn encode(
        &self,
        inputs: Vec<EncodeInput>,
        truncation: Truncation,
    ) -> Result<Vec<TokenizedInput>, TokenizeError> {
        let encodings = self
            .tokenizer
            .encode_batch(inputs, true)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        encodings
            .into_iter()
            .enumerate()
            .map(|(index, enc)| accept(index, enc, truncation, self.max_tokens))
            .collect()
    }
}
