//! Configuration: the partial config push and its merge ([`push`]), the agent's TOML file
//! ([`agent`]), one local model ([`model`]), one model server the agent fronts
//! ([`local_server`]), where tokens come from ([`tokens`]), the hub's
//! settings ([`hub`]) and each role's lease and timeouts ([`timings`]).

pub mod agent;
pub mod hub;
pub mod local_server;
pub mod model;
pub mod push;
pub mod timings;
pub mod tokens;
