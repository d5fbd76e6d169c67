//! fantom-sidecar: the GPU inference sidecar of Fantom MCP Server.
//!
//! Module map (one concern each; see `docs/architecture.md`):
//! * [`model_spec`]: what a model is (architecture, task, pooling, limits, prompts).
//! * [`manifest`]: pinned model manifests (`models/*.toml`), digests and `models.lock`.
//! * [`model_source`]: where model files come from (HF cache, hub download, a folder) and
//!   proof that they are the pinned bytes.
//! * [`inference`]: the local engine: tokenization, batching, the model thread, model code.
//! * [`roles`]: the five inference roles and the routing policies.
//! * [`histogram`]: Prometheus histograms (fixed buckets, text exposition).
//! * [`quantize`]: Cohere's quantized embedding types (int8 with a space's scale, sign bits).
//! * [`secret`]: the type that holds the OpenRouter key and tokens without leaking them.
//! * [`protocol`]: the fleet protocol's frames (hub ⇄ agent) and their codec.
//! * [`config`]: config pushes and their merge, the agent's file, model choices, tokens.
//! * [`cloud`]: OpenRouter routes, their client, wire format and failure classes.
//! * [`hub`]: shared role queues, requests bound to one space or scorer, leases, dispatch,
//!   policy, the cloud budget, the compatibility gate, persisted state.
//! * [`http`]: the hub's client, admin and ops APIs, and the agents' WebSocket endpoint.
//! * [`agent`]: providers, the pull loop and the one socket to the hub.
//! * [`fantom`]: the drop-in for Fantom's existing sidecar relay and its HTTP routes.
//! * [`service`]: running under systemd (notify, watchdog, credentials).
//! * [`cli`]: the `fantom-sidecar` command line.

pub mod agent;
pub mod cli;
pub mod cloud;
pub mod config;
pub mod fantom;
pub mod http;
pub mod hub;
pub mod inference;
pub mod manifest;
pub mod metrics;
pub mod model_source;
pub mod model_spec;
pub mod protocol;
pub mod quantize;
pub mod roles;
pub mod secret;
pub mod service;
pub mod traces;
