//! Printing: JSON, tables, errors, decoded output chunks.

use std::io::Write;

use base64::Engine;
use moat_api::OutputChunk;

/// Prints a value as pretty JSON on stdout.
pub fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    println!("{text}");
    Ok(())
}

/// Prints `error: <message>` (with the causes) on stderr.
pub fn print_error(e: &anyhow::Error) {
    eprintln!("error: {}", error_message(e));
}

/// The error and its causes joined by `: `, leaving out causes already quoted by the message
/// before them (client errors embed their source in their own text).
pub fn error_message(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if msg.contains(&text) {
            continue;
        }
        if !msg.is_empty() {
            msg.push_str(": ");
        }
        msg.push_str(&text);
    }
    msg
}

/// Flushes stdout and stderr (errors ignored: the reader may be gone).
pub fn flush() {
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
}

/// Prints rows as left-aligned columns under a header.
pub fn print_table(headers: &[&str], rows: &[Vec<String>]) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(render_table(headers, rows).as_bytes());
}

/// Renders rows as left-aligned columns separated by three spaces.
pub fn render_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let mut text = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                l.push_str("   ");
            }
            let width = widths.get(i).copied().unwrap_or(0);
            l.push_str(&format!("{cell:<width$}"));
        }
        text.push_str(l.trim_end());
        text.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    text
}

/// The bytes of an output chunk (`data`, or `data_b64` decoded).
pub fn chunk_bytes(chunk: &OutputChunk) -> anyhow::Result<Vec<u8>> {
    if let Some(data) = &chunk.data {
        return Ok(data.as_bytes().to_vec());
    }
    if let Some(b64) = &chunk.data_b64 {
        return base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| anyhow::anyhow!("bad base64 in output chunk: {e}"));
    }
    Ok(Vec::new())
}

/// Writes bytes to a stream and flushes, ignoring a closed pipe on our side.
pub fn write_out(w: &mut dyn Write, bytes: &[u8]) -> std::io::Result<()> {
    w.write_all(bytes)?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_chain_without_repeats() {
        let inner = std::io::Error::other("disk full");
        let e = anyhow::Error::new(moat_client::Error::Io(inner)).context("writing /tmp/x");
        assert_eq!(error_message(&e), "writing /tmp/x: I/O error: disk full");
    }

    #[test]
    fn table() {
        let t = render_table(
            &["ID", "STATE"],
            &[
                vec!["sbx_1".into(), "running".into()],
                vec!["x".into(), "".into()],
            ],
        );
        assert_eq!(t, "ID      STATE\nsbx_1   running\nx\n");
    }

    #[test]
    fn chunks() {
        let c = OutputChunk {
            data: Some("hé".into()),
            ..Default::default()
        };
        assert_eq!(chunk_bytes(&c).unwrap(), "hé".as_bytes());
        let c = OutputChunk {
            data_b64: Some("/wA=".into()),
            ..Default::default()
        };
        assert_eq!(chunk_bytes(&c).unwrap(), vec![0xff, 0]);
        let c = OutputChunk {
            data_b64: Some("!!".into()),
            ..Default::default()
        };
        assert!(chunk_bytes(&c).is_err());
    }
}
