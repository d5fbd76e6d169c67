//! The real binary: `embed`, `rerank` and `models`, JSON Lines in and out.

use serde_json::Value;

use crate::support::*;

fn lines(stdout: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn envs(tmp: &std::path::Path) -> Vec<(String, String)> {
    vec![
        (
            "FANTOM_MODELS_LOCK".into(),
            tmp.join("models.lock").display().to_string(),
        ),
        ("HF_HUB_CACHE".into(), tmp.join("hf").display().to_string()),
        ("HF_ENDPOINT".into(), closed_endpoint()),
        // Nor PyPI: a missing model fails here instead of being fetched.
        (
            "PIP_INDEX_URL".into(),
            format!("{}/simple", closed_endpoint()),
        ),
        (
            "XDG_CACHE_HOME".into(),
            tmp.join("cache").display().to_string(),
        ),
    ]
}

fn run(
    args: &[&str],
    stdin: &str,
    tmp: &std::path::Path,
    extra: &[(&str, &str)],
) -> std::process::Output {
    let owned = envs(tmp);
    let mut all: Vec<(&str, &str)> = owned
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    all.extend_from_slice(extra);
    run_cli(args, stdin, &all)
}

/// `embed` of the pinned MiniLM on the CPU, with `extra` flags, `stdin` in.
fn embed_pinned_minilm(extra: &[&str], stdin: &str, tmp: &std::path::Path) -> std::process::Output {
    let dir = minilm_dir();
    let mut args = vec![
        "embed",
        "--model",
        "all-minilm-l6-v2",
        "--model-dir",
        dir.to_str().unwrap(),
        "--device",
        "cpu",
    ];
    args.extend_from_slice(extra);
    run(&args, stdin, tmp, &[])
}

#[test]
fn embed_reproduces_sentence_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let texts = texts();
    let out = embed_pinned_minilm(&[], &json_lines(&texts), tmp.path());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let got = lines(&out.stdout);
    assert_eq!(got.len(), texts.len());
    let reference = minilm_reference();
    for (i, line) in got.iter().enumerate() {
        assert_eq!(line["index"], i, "input order");
        let v: Vec<f32> = serde_json::from_value(line["embedding"].clone()).unwrap();
        assert!(cosine(&v, &reference.mean[i]) >= 0.9999, "line {i}");
        assert!(max_abs_diff(&v, &reference.mean[i]) <= 1e-4, "line {i}");
    }
    let raw = String::from_utf8_lossy(&out.stdout);
    assert!(
        raw.starts_with("{\"index\":0,\"embedding\":["),
        "index comes first"
    );
    assert!(
        stderr.contains("model loaded") && stderr.contains("pinned"),
        "{stderr}"
    );
}

#[test]
fn embed_with_dimensions_and_an_unpinned_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = minilm_dir();
    let out = run(
        &[
            "embed",
            "--model-dir",
            dir.to_str().unwrap(),
            "--dimensions",
            "32",
        ],
        "\"a\"\n\"b\"\n",
        tmp.path(),
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let got = lines(&out.stdout);
    assert_eq!(got[1]["embedding"].as_array().unwrap().len(), 32);
    assert!(
        stderr.contains("unpinned"),
        "an unpinned load says so: {stderr}"
    );
}

#[test]
fn rerank_writes_scores_in_input_order() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = assemble_cross_encoder(tmp.path());
    let case = &cross_encoder_reference().cases[1];
    let out = run(
        &[
            "rerank",
            "--model-dir",
            dir.to_str().unwrap(),
            "--query",
            &case.query,
        ],
        &json_lines(&case.documents),
        tmp.path(),
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = lines(&out.stdout);
    assert_eq!(got.len(), case.documents.len());
    for (i, line) in got.iter().enumerate() {
        assert_eq!(line["index"], i);
        let score = line["score"].as_f64().unwrap() as f32;
        assert!((score - case.logits[i]).abs() <= 1e-4, "doc {i}");
        let p = line["probability"].as_f64().unwrap() as f32;
        assert!((p - 1.0 / (1.0 + (-score).exp())).abs() <= 1e-6);
    }
}

#[test]
fn bad_input_fails_clearly_before_loading_anything() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = minilm_dir();
    let dir = dir.to_str().unwrap();
    let cases: [(&str, &str); 4] = [
        ("\"fine\"\nnot json\n", "line 2: expected a JSON string"),
        ("\"fine\"\n\"\"\n", "line 2: empty string"),
        ("", "no input"),
        ("{\"text\": \"x\"}\n", "line 1: expected a JSON string"),
    ];
    for (stdin, want) in cases {
        let out = run(&["embed", "--model-dir", dir], stdin, tmp.path(), &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stdin:?}: {stderr}");
        assert!(stderr.contains(want), "{stdin:?}: {stderr}");
        assert!(
            !stderr.contains("model loaded"),
            "input is checked first: {stderr}"
        );
        assert!(out.stdout.is_empty());
    }
    let out = run(&["embed"], "\"x\"\n", tmp.path(), &[]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--model <id>"));
}

#[test]
fn no_truncate_names_the_long_input() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = minilm_dir();
    let long = "token ".repeat(300);
    let stdin = json_lines(&["short".to_string(), long]);
    let out = run(
        &[
            "embed",
            "--model-dir",
            dir.to_str().unwrap(),
            "--no-truncate",
        ],
        &stdin,
        tmp.path(),
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("input 1 is longer than the model's 256 tokens"),
        "{stderr}"
    );
}

#[test]
fn offline_without_a_cache_says_how_to_provide_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let out = run(
        &["embed", "--model", "all-minilm-l6-v2"],
        "\"x\"\n",
        tmp.path(),
        &[("HF_HUB_OFFLINE", "1")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--model-dir DIR") && stderr.contains("HF_HUB_OFFLINE"),
        "{stderr}"
    );
}

#[test]
fn models_list_and_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let out = run(&["models", "list"], "", tmp.path(), &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        stdout.contains("all-minilm-l6-v2") && stdout.contains("ms-marco-minilm-l6-v2"),
        "{stdout}"
    );
    let dir = minilm_dir();
    let out = run(
        &[
            "models",
            "verify",
            "all-minilm-l6-v2",
            "--model-dir",
            dir.to_str().unwrap(),
        ],
        "",
        tmp.path(),
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["revision"], "c9745ed1d9f207416be6d2e6f8de32d1f16199bf");
    assert_eq!(v["files"].as_array().unwrap().len(), 3);
}

#[test]
fn an_impossible_batch_budget_is_refused_at_start_with_one_that_fits() {
    let tmp = tempfile::tempdir().unwrap();
    // A billion tokens in up to a million rows: terabytes of activations on this host.
    let out = embed_pinned_minilm(
        &[
            "--max-batch-tokens",
            "1073741824",
            "--max-batch-rows",
            "1048576",
        ],
        &json_lines(&["never embedded".to_string()]),
        tmp.path(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(out.stdout.is_empty(), "nothing was served");
    assert!(stderr.contains("max_batch_tokens 1073741824"), "{stderr}");
    assert!(
        stderr.contains("set max_batch_tokens to at most"),
        "{stderr}"
    );
    // The number it suggests does start.
    let suggested: usize = stderr
        .split("set max_batch_tokens to at most ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a number in: {stderr}"));
    // Half of it, so the host's memory moving a little between runs cannot matter.
    let half = (suggested / 2 / 256 * 256).max(256).to_string();
    let out = embed_pinned_minilm(
        &["--max-batch-tokens", &half, "--max-batch-rows", "1048576"],
        &json_lines(&["embedded".to_string()]),
        tmp.path(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(lines(&out.stdout).len(), 1);
}

/// Completions and the man page come from the command line's own definition: bash takes the
/// script, and each names the subcommands.
#[test]
fn completions_and_the_man_page_are_generated_from_the_cli() {
    let tmp = tempfile::tempdir().unwrap();
    let out = run(&["completions", "bash"], "", tmp.path(), &[]);
    assert!(out.status.success());
    let script = tmp.path().join("fantom-sidecar.bash");
    std::fs::write(&script, &out.stdout).unwrap();
    let loaded = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(
            "source {} && complete -p fantom-sidecar",
            script.display()
        ))
        .output()
        .unwrap();
    assert!(
        loaded.status.success()
            && String::from_utf8_lossy(&loaded.stdout).contains("fantom-sidecar"),
        "{loaded:?}"
    );
    for (shell, marker) in [
        ("zsh", "#compdef fantom-sidecar"),
        ("fish", "complete -c fantom-sidecar"),
    ] {
        let out = run(&["completions", shell], "", tmp.path(), &[]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains(marker),
            "{shell}: {text}"
        );
        assert!(
            text.contains("serve") && text.contains("projects"),
            "{shell}"
        );
    }
    let out = run(&["man"], "", tmp.path(), &[]);
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(page.contains(".TH fantom-sidecar"), "{page}");
    assert!(
        page.contains("serve") && page.contains("completions"),
        "{page}"
    );
}
