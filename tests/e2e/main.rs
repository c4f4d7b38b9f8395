//! End-to-end tests: a real daemon, real sandboxes (namespaces, cgroups, overlayfs), real clients.
//! They need root, like moat itself; `scripts/test.sh` runs them.

mod harness;

mod audit;
mod bad_input;
mod builds;
mod causes;
mod chaos;
mod cli;
mod code;
mod commands;
mod density;
mod diskfull;
mod escape;
mod files;
mod forksafety;
mod hardening;
mod honest;
mod hostile;
mod images;
mod isolation;
mod lifecycle;
mod limits;
mod network;
mod pool;
mod ports;
mod restart;
mod secrets;
mod snapshots;
mod topology;
