//! The gvisor tier's checkpoint handshake between the daemon and the agent (docs/gvisor-tier.md).
//!
//! gVisor cannot save a Unix socket bound to a host file, and the agent listens on one. The daemon
//! creates [`REQUEST`] in the agent's socket directory and sends the agent SIGUSR1; the agent either
//! refuses — it writes [`REFUSED`] there with the paths of the Unix sockets processes of the sandbox
//! have bound to files, one per line, which runsc could not save either — or closes its connections
//! and listener and creates [`QUIESCED`]. After the checkpoint, SIGUSR2 makes it listen again (in
//! the sandbox and in every copy restored from the image).

/// Made by the daemon next to the agent's socket before it sends SIGUSR1.
pub const REQUEST: &str = "checkpoint";
/// Made by the agent next to its socket once it has let go of it.
pub const QUIESCED: &str = "quiesced";
/// Made by the agent instead of [`QUIESCED`] when the sandbox holds sockets runsc cannot save.
pub const REFUSED: &str = "refused";

/// (inode, path) of each socket bound to a file path in a `/proc/<pid>/net/unix` table (abstract
/// and unbound sockets left out).
pub fn unix_sockets_bound_to_paths(table: &str) -> Vec<(String, String)> {
    let mut bound = Vec::new();
    for line in table.lines().skip(1) {
        // Num RefCount Protocol Flags Type St Inode [Path]: the inode is space-padded.
        let mut rest = line;
        let mut fields = Vec::with_capacity(7);
        for _ in 0..7 {
            rest = rest.trim_start();
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            fields.push(&rest[..end]);
            rest = &rest[end..];
        }
        let path = rest.strip_prefix(' ').unwrap_or(rest);
        if !fields[6].is_empty() && !path.is_empty() && !path.starts_with('@') {
            bound.push((fields[6].to_string(), path.to_string()));
        }
    }
    bound
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_socket_table_lists_path_bound_sockets() {
        let table = "Num       RefCount Protocol Flags    Type St Inode Path\n\
            00000000db295c61: 00000002 00000000 00010000 0001 01 444582 /root/app.sock\n\
            0000000000000000: 00000002 00000000 00000000 0001 03    17\n\
            0000000000000000: 00000002 00000000 00010000 0001 01    18 @abstract\n\
            0000000075f4e0ed: 00000002 00000000 00010000 0001 01 437118 /tmp/with space.sock\n";
        assert_eq!(
            unix_sockets_bound_to_paths(table),
            vec![
                ("444582".to_string(), "/root/app.sock".to_string()),
                ("437118".to_string(), "/tmp/with space.sock".to_string()),
            ]
        );
        assert!(unix_sockets_bound_to_paths("").is_empty());
    }
}
