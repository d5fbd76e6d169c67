//! Configuration: the partial config push and its merge ([`push`]), the agent's TOML file
//! ([`agent`]), one local model ([`model`]), and where tokens come from ([`tokens`]).

pub mod agent;
pub mod hub;
pub mod model;
pub mod push;
pub mod tokens;
