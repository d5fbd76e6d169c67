//! pip's configuration, read the way pip reads it, for the PyPI mirror ([`super::pypi`]): which
//! index to ask and which certificates to trust. Python is not needed: the files and variables
//! are read here.
//!
//! Files, each later one overriding the earlier (pip's `configuration.py`):
//! 1. global: `pip/pip.conf` under each of `$XDG_CONFIG_DIRS` (default `/etc/xdg`), then
//!    `/etc/pip.conf`;
//! 2. user: `~/.pip/pip.conf`, then `$XDG_CONFIG_HOME/pip/pip.conf` (default `~/.config`);
//!    skipped when `PIP_CONFIG_FILE` names a file that exists;
//! 3. site: `$VIRTUAL_ENV/pip.conf`;
//! 4. the file `PIP_CONFIG_FILE` names (`/dev/null`: no files are read at all).
//!
//! Every file's `[global]` applies, then every file's `[download]` overrides it (fetching a
//! package is what `pip download` does; so `[download]` in `/etc/pip.conf` beats `[global]` in
//! the user's file, as in pip); then `PIP_INDEX_URL`, `PIP_EXTRA_INDEX_URL`, `PIP_CERT` and
//! `PIP_TRUSTED_HOST` override every file. The keys used: `index-url`, `extra-index-url`,
//! `cert` and `trusted-host`. Certificates: the built-in roots, the system's bundle
//! (`SSL_CERT_FILE`, else Debian's and Red Hat's usual paths), pip's `cert`, and
//! `REQUESTS_CA_BUNDLE` / `CURL_CA_BUNDLE`, which pip's requests honours too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// PyPI's simple index, pip's default.
pub const DEFAULT_INDEX: &str = "https://pypi.org/simple";

/// The system CA bundles looked for when `SSL_CERT_FILE` is not set.
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

/// What the PyPI mirror takes from pip's configuration (its `Debug` shows index URLs without
/// their user and password).
#[derive(Clone, PartialEq, Eq)]
pub struct PipConfig {
    /// The indexes to ask, in order: `index-url`, then each `extra-index-url`.
    pub indexes: Vec<String>,
    /// PEM bundles to trust besides the built-in roots.
    pub certs: Vec<PathBuf>,
    /// Hosts (`host` or `host:port`) whose certificates are not checked, as pip does.
    pub trusted_hosts: Vec<String>,
    /// The configuration files read, in order (for the log and error messages).
    pub files: Vec<PathBuf>,
}

impl PipConfig {
    /// The configuration of this process.
    pub fn from_env() -> Self {
        Self::read(&|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }

    /// The configuration `env` describes (a variable's value by its name).
    pub fn read(env: &dyn Fn(&str) -> Option<String>) -> Self {
        Self::read_under(env, Path::new("/etc"))
    }

    /// As [`Self::read`], with `etc` for `/etc` (tests).
    pub fn read_under(env: &dyn Fn(&str) -> Option<String>, etc: &Path) -> Self {
        // pip takes every file's `[global]` (later files over earlier), then every file's
        // `[download]` over that, then the variables.
        let mut files = Vec::new();
        let mut parsed = Vec::new();
        for path in config_files(env, etc) {
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            parsed.push(parse_ini(&text));
            files.push(path);
        }
        let mut settings = BTreeMap::new();
        for section in ["global", "download"] {
            for sections in &parsed {
                if let Some(values) = sections.get(section) {
                    settings.extend(values.clone());
                }
            }
        }
        for (key, var) in [
            ("index-url", "PIP_INDEX_URL"),
            ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
            ("cert", "PIP_CERT"),
            ("trusted-host", "PIP_TRUSTED_HOST"),
        ] {
            if let Some(value) = env(var) {
                settings.insert(key.to_string(), value);
            }
        }
        let list = |key: &str| -> Vec<String> {
            settings
                .get(key)
                .map(|v| v.split_whitespace().map(str::to_string).collect())
                .unwrap_or_default()
        };
        let mut indexes = vec![
            settings
                .get("index-url")
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|| DEFAULT_INDEX.to_string()),
        ];
        indexes.extend(list("extra-index-url"));
        let mut certs: Vec<PathBuf> = Vec::new();
        let system = env("SSL_CERT_FILE").map(PathBuf::from).or_else(|| {
            SYSTEM_BUNDLES
                .iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())
        });
        for path in [
            system,
            settings.get("cert").map(|c| PathBuf::from(c.trim())),
            env("REQUESTS_CA_BUNDLE").map(PathBuf::from),
            env("CURL_CA_BUNDLE").map(PathBuf::from),
        ]
        .into_iter()
        .flatten()
        {
            if !certs.contains(&path) {
                certs.push(path);
            }
        }
        PipConfig {
            indexes,
            certs,
            trusted_hosts: list("trusted-host"),
            files,
        }
    }

    /// Whether pip would skip certificate checks for `host` (with its `port`).
    pub fn trusts_host(&self, host: &str, port: Option<u16>) -> bool {
        self.trusted_hosts.iter().any(|t| match t.rsplit_once(':') {
            Some((h, p)) if p.parse::<u16>().is_ok() => {
                h.eq_ignore_ascii_case(host) && p.parse::<u16>().ok() == port
            }
            _ => t.eq_ignore_ascii_case(host),
        })
    }
}

impl std::fmt::Debug for PipConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let indexes: Vec<String> = self.indexes.iter().map(|i| shown_url(i)).collect();
        f.debug_struct("PipConfig")
            .field("indexes", &indexes)
            .field("certs", &self.certs)
            .field("trusted_hosts", &self.trusted_hosts)
            .field("files", &self.files)
            .finish()
    }
}

/// A URL as it may be shown: without a user or password.
pub fn shown_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.to_string()
        }
        Err(_) => "(an index URL that does not parse)".to_string(),
    }
}

/// The configuration files pip would read, in override order (existing or not).
fn config_files(env: &dyn Fn(&str) -> Option<String>, etc: &Path) -> Vec<PathBuf> {
    let named = env("PIP_CONFIG_FILE").map(PathBuf::from);
    if named.as_deref() == Some(Path::new("/dev/null")) {
        return Vec::new();
    }
    let mut files = Vec::new();
    let xdg_dirs = env("XDG_CONFIG_DIRS").unwrap_or_else(|| "/etc/xdg".to_string());
    files.extend(
        xdg_dirs
            .split(':')
            .filter(|d| !d.is_empty())
            .map(|d| Path::new(d).join("pip/pip.conf")),
    );
    files.push(etc.join("pip.conf"));
    let named_exists = named.as_deref().is_some_and(Path::is_file);
    if !named_exists && let Some(home) = env("HOME").map(PathBuf::from) {
        files.push(home.join(".pip/pip.conf"));
        let config_home = env("XDG_CONFIG_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| home.join(".config"));
        files.push(config_home.join("pip/pip.conf"));
    }
    if let Some(venv) = env("VIRTUAL_ENV") {
        files.push(Path::new(&venv).join("pip.conf"));
    }
    files.extend(named);
    files
}

/// An INI file as Python's configparser reads pip's: `[section]`, `key = value` or
/// `key: value`, `#`/`;` comment lines, indented lines continuing the value above. Keys are
/// lower-cased with `_` as `-`, as pip normalises them.
fn parse_ini(text: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut sections: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut section: Option<String> = None;
    let mut last_key: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with(';') {
            continue;
        }
        let continues = line.starts_with(|c: char| c.is_whitespace());
        if continues
            && let (Some(s), Some(k)) = (&section, &last_key)
            && let Some(value) = sections.get_mut(s).and_then(|v| v.get_mut(k))
        {
            value.push('\n');
            value.push_str(trimmed);
            continue;
        }
        if let Some(name) = trimmed.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
            section = Some(name.trim().to_string());
            last_key = None;
            continue;
        }
        let Some(s) = &section else { continue };
        let Some(at) = trimmed.find(['=', ':']) else {
            continue;
        };
        let key = trimmed[..at].trim().to_lowercase().replace('_', "-");
        let value = trimmed[at + 1..].trim().to_string();
        sections
            .entry(s.clone())
            .or_default()
            .insert(key.clone(), value);
        last_key = Some(key);
    }
    sections
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, String)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn files_override_in_pips_order_and_variables_override_files() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home");
        let xdg = dir.path().join("xdg");
        let etc = dir.path().join("etc");
        std::fs::create_dir_all(home.join(".pip")).unwrap();
        std::fs::create_dir_all(xdg.join("pip")).unwrap();
        std::fs::create_dir_all(home.join(".config/pip")).unwrap();
        std::fs::write(
            xdg.join("pip/pip.conf"),
            "[global]\nindex-url = http://global/simple\ncert = /global.pem\n",
        )
        .unwrap();
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::write(
            etc.join("pip.conf"),
            "[download]\ntrusted-host = from-etc\n",
        )
        .unwrap();
        std::fs::write(
            home.join(".pip/pip.conf"),
            "[global]\nindex_url: http://legacy/simple\n",
        )
        .unwrap();
        std::fs::write(
            home.join(".config/pip/pip.conf"),
            "# user\n[global]\nindex-url = http://user/simple\ntrusted-host = from-user\nextra-index-url =\n    http://a/simple\n    http://b/simple\n[install]\nindex-url = http://install-only/simple\n",
        )
        .unwrap();
        let base = vec![
            ("HOME", home.display().to_string()),
            ("XDG_CONFIG_DIRS", xdg.display().to_string()),
            ("SSL_CERT_FILE", "/system.pem".to_string()),
        ];
        let config = PipConfig::read_under(&env_of(&base), &etc);
        assert_eq!(
            config.indexes,
            ["http://user/simple", "http://a/simple", "http://b/simple"]
        );
        assert_eq!(
            config.certs,
            [PathBuf::from("/system.pem"), PathBuf::from("/global.pem")]
        );
        assert_eq!(config.files.len(), 4, "{:?}", config.files);
        assert_eq!(config.trusted_hosts, ["from-etc"]);

        // [download] beats [global] in any file; PIP_* beat every file.
        let named = dir.path().join("named.conf");
        std::fs::write(
            &named,
            "[download]\nindex-url = http://download/simple\ntrusted-host = mirror.local mirror2:8443\n",
        )
        .unwrap();
        let mut with_named = base.clone();
        with_named.push(("PIP_CONFIG_FILE", named.display().to_string()));
        let config = PipConfig::read_under(&env_of(&with_named), &etc);
        assert_eq!(config.indexes[0], "http://download/simple");
        assert!(
            !config.files.iter().any(|f| f.starts_with(&home)),
            "an existing PIP_CONFIG_FILE skips the user files: {:?}",
            config.files
        );
        assert!(
            config.trusts_host("mirror.local", Some(443)),
            "[download] in the named file beats [download] in /etc: {:?}",
            config.trusted_hosts
        );
        assert!(config.trusts_host("mirror2", Some(8443)));
        assert!(!config.trusts_host("mirror2", Some(443)));
        with_named.push(("PIP_INDEX_URL", "http://env/simple".to_string()));
        with_named.push(("PIP_CERT", "/env.pem".to_string()));
        let config = PipConfig::read_under(&env_of(&with_named), &etc);
        assert_eq!(config.indexes, ["http://env/simple"]);
        assert!(config.certs.contains(&PathBuf::from("/env.pem")));

        // PIP_CONFIG_FILE=/dev/null: no files, pip's defaults.
        let mut none = base.clone();
        none.push(("PIP_CONFIG_FILE", "/dev/null".to_string()));
        let config = PipConfig::read_under(&env_of(&none), &etc);
        assert_eq!(config.indexes, [DEFAULT_INDEX]);
        assert!(config.files.is_empty());

        // A user and password in an index URL never show in a Debug print.
        let mut secret = base.clone();
        secret.push((
            "PIP_INDEX_URL",
            "https://me:s3cr3t@mirror.local/simple".to_string(),
        ));
        let shown = format!("{:?}", PipConfig::read_under(&env_of(&secret), &etc));
        assert!(
            shown.contains("mirror.local") && !shown.contains("s3cr3t"),
            "{shown}"
        );
    }
}
