//! Templates: the read-only root filesystems sandboxes start from.
//!
//! `debootstrap` builds the `base` template from Debian packages; `import` registers a root filesystem
//! directory or tarball from the host.

pub mod debootstrap;
pub mod import;
pub mod oci;
pub mod spec;
pub mod store;
