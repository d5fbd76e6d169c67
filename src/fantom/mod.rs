//! The drop-in for Fantom MCP Server's existing GPU sidecar relay.
//!
//! Fantom's master runs a dedicated relay listener, `ws://<master>:<wsPort>/sidecar` (wsPort
//! 3003 for Fantom; 3002 is Sound Suite's relay and the port a slot without one dials), that
//! its Node sidecars dial out to: `register`, `heartbeat` every 5 s, `result` for each
//! `command`, and `config` pushes of the OpenRouter settings. It also calls the sidecar's HTTP
//! port (8098) and the role containers' ports directly. This module tree lets our agent stand
//! in for that sidecar and its containers, one slot per master, with no change on the master.
//!
//! The hub protocol ([`crate::protocol`]) is the way forward: a hub that routes roles across
//! GPUs and OpenRouter. This relay is the bridge for masters as they are today; the config
//! push it receives is merged by the same code as the hub's ([`crate::config::push`]).
//!
//! Section numbers (§) in this tree refer to the relay protocol reference
//! (`fantom-relay-protocol.md`, written from the master's source), summarized in
//! `docs/fantom.md`.
//!
//! Submodules:
//! * [`frames`]: the relay's JSON frames both ways (`register`, `heartbeat`, `result`;
//!   `registered`, `command`, `error`, `master-identity`, `config`/`config-push`), the
//!   commands' typed payloads and results, and their codec.
//! * [`status`]: the status snapshot shared by `heartbeat.statusData` and `GET /api/status`
//!   (containers per role, roles, GPUs, VRAM, `masters[]` with the virtual containers).
//! * [`slots`]: one slot per master, keyed by its `serverUrl`: its relay port, the config its
//!   pushes left (the key in memory only) and its socket's state.
//! * [`relay`]: one sequential connection loop per slot: register, heartbeats, commands,
//!   config pushes, `master-identity`, reconnect with backoff.
//! * [`snapshot`]: the agent's identity for masters ([`snapshot::RelayContext`]) and the
//!   `statusData` built from it, the containers and the slots.
//! * [`containers`]: the local roles as the containers a master knows, with `start`/`stop`/
//!   `acquire`/`release` (a candle model, or a fronted embedding server).
//! * [`server_container`]: a fronted chat server (the RLM's vLLM, Ollama's completion) as its
//!   container; the master calls its own port.
//! * [`commands`]: the answers to the relay's commands (the virtual commands on the slot's
//!   key and pinned models; the container actions).
//! * [`sidecar`]: all of the above for one agent, and its relay loops.
//! * [`http`]: the agent's HTTP surface for masters (status, masters, role endpoints, chat
//!   proxy), with the bearer check.

pub mod commands;
pub mod containers;
pub mod frames;
pub mod http;
pub mod relay;
pub mod server_container;
pub mod sidecar;
pub mod slots;
pub mod snapshot;
pub mod status;

#[cfg(test)]
mod tests;
