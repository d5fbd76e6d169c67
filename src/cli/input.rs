//! Reading the one-shot commands' input: JSON Lines, each line one JSON string.

use std::io::BufRead;

/// Why the input could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("cannot read stdin: {0}")]
    Io(#[from] std::io::Error),
    #[error(
        "line {line}: expected a JSON string (JSON Lines input, one string per line): {message}"
    )]
    NotAString { line: usize, message: String },
    #[error("line {line}: empty string; every input must have text")]
    Empty { line: usize },
    #[error(
        "no input: write JSON Lines to stdin, one JSON string per line, e.g. \"fn main() {{}}\""
    )]
    NoInput,
}

/// Reads every line of `reader` as a JSON string. Line numbers in errors start at 1.
pub fn read_json_lines(reader: impl BufRead) -> Result<Vec<String>, InputError> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line?;
        let number = i + 1;
        let text: String = serde_json::from_str(&line).map_err(|e| InputError::NotAString {
            line: number,
            message: if line.trim().is_empty() {
                "the line is blank".to_string()
            } else {
                e.to_string()
            },
        })?;
        if text.is_empty() {
            return Err(InputError::Empty { line: number });
        }
        out.push(text);
    }
    if out.is_empty() {
        return Err(InputError::NoInput);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_strings_and_names_bad_lines() {
        let ok = read_json_lines("\"a\"\n\"b\\nc\"\n".as_bytes()).unwrap();
        assert_eq!(ok, ["a", "b\nc"]);
        let err = read_json_lines("\"a\"\n{\"x\":1}\n".as_bytes()).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("line 2: expected a JSON string"),
            "{err}"
        );
        let err = read_json_lines("\"a\"\n\n\"b\"".as_bytes()).unwrap_err();
        assert!(
            err.to_string().contains("line 2") && err.to_string().contains("blank"),
            "{err}"
        );
        let err = read_json_lines("\"\"\n".as_bytes()).unwrap_err();
        assert!(matches!(err, InputError::Empty { line: 1 }));
        assert!(matches!(
            read_json_lines("".as_bytes()).unwrap_err(),
            InputError::NoInput
        ));
    }
}
