//! Host mechanisms, one module each. Nothing here knows about sandboxes as an API concept: each module
//! creates, inspects and removes one kind of kernel object.

pub mod caps;
pub mod cgroup;
pub mod diskimage;
pub mod egress;
pub mod kmsg;
pub mod lxcfs;
pub mod mount;
pub mod net;
pub mod proc;
pub mod seccomp;
pub mod userns;
