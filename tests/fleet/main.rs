//! The fleet end to end: real hub, agent and serve processes on loopback sockets.

#[path = "../local_inference/support.rs"]
#[allow(dead_code)]
mod local_support;

#[path = "../local_inference/pypi_index.rs"]
#[allow(dead_code)]
mod pypi_index;

mod support;

mod bad_input;
mod black_hole;
mod budget;
mod clients;
mod cloud;
mod console;
mod contract;
mod etcd_cluster;
mod fantom_master;
mod first_run;
mod gate;
mod ha;
mod ha_degraded;
mod ha_faults;
mod hostile;
mod integrity;
mod kill;
mod leases;
mod liveness;
mod local_servers;
mod masters;
mod migration;
mod model_servers;
mod otlp_receiver;
mod projects;
mod reconnect;
mod relay;
mod relay_commands;
mod seams;
mod secrets;
mod serve;
mod service;
mod state_store;
mod telemetry;
mod tls;
mod upstream;
