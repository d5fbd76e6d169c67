//! Whole numbers as clients send them. JSON has one number type, and JSON Schema counts `8.0`
//! as an integer, so clients generated from a schema (and Python clients passing a float) may
//! send `"dimensions": 8.0`. A count field here takes any number with no fractional part and
//! refuses `8.5`, a negative count or one past its type's range, with the field's name.
//!
//! Used as `#[serde(default, deserialize_with = "whole_number::optional")]` on `Option<T>`
//! fields of client request bodies.

use serde::Deserialize;
use serde::de::{Deserializer, Error as _};

/// The largest integer an f64 holds exactly: past it, `x.0` may not be the number sent.
const MAX_EXACT_F64: f64 = 9_007_199_254_740_992.0;

/// The whole number `n` is, if it is one.
pub fn of(n: &serde_json::Number) -> Option<u64> {
    if let Some(u) = n.as_u64() {
        return Some(u);
    }
    let f = n.as_f64()?;
    (f.fract() == 0.0 && (0.0..=MAX_EXACT_F64).contains(&f)).then_some(f as u64)
}

/// An optional whole number of type `T` (`null` or absent is `None`).
pub fn optional<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<u64>,
{
    let Some(n) = Option::<serde_json::Number>::deserialize(deserializer)? else {
        return Ok(None);
    };
    let whole = of(&n).ok_or_else(|| {
        D::Error::custom(format!(
            "{n} is not a whole number of at least 0 (a count: 8 or 8.0, not 8.5)"
        ))
    })?;
    T::try_from(whole)
        .map(Some)
        .map_err(|_| D::Error::custom(format!("{whole} is too large")))
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct Body {
        #[serde(default, deserialize_with = "super::optional")]
        n: Option<u32>,
    }

    fn parse(s: &str) -> Result<Option<u32>, String> {
        serde_json::from_str::<Body>(s)
            .map(|b| b.n)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn integral_floats_are_integers_and_fractions_are_refused() {
        assert_eq!(parse(r#"{"n": 8}"#), Ok(Some(8)));
        assert_eq!(parse(r#"{"n": 8.0}"#), Ok(Some(8)));
        assert_eq!(parse(r#"{"n": 8e0}"#), Ok(Some(8)));
        assert_eq!(parse(r#"{"n": null}"#), Ok(None));
        assert_eq!(parse("{}"), Ok(None));
        assert!(
            parse(r#"{"n": 8.5}"#)
                .unwrap_err()
                .contains("not a whole number")
        );
        assert!(
            parse(r#"{"n": -1}"#)
                .unwrap_err()
                .contains("not a whole number")
        );
        assert!(
            parse(r#"{"n": -1.0}"#)
                .unwrap_err()
                .contains("not a whole number")
        );
        assert!(
            parse(r#"{"n": 1e300}"#)
                .unwrap_err()
                .contains("not a whole number")
        );
        assert!(
            parse(r#"{"n": 4294967296}"#)
                .unwrap_err()
                .contains("too large")
        );
        assert!(parse(r#"{"n": "8"}"#).is_err());
    }
}
