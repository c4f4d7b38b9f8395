//! Interactive PTY sessions over the process WebSocket: `moat shell` and `moat exec -t`.

use std::io::IsTerminal;

use futures::{SinkExt, StreamExt};
use moat_api::{ProcessEvent, PtySize, StartProcessRequest};
use moat_client::Client;
use nix::sys::termios::{self, SetArg, Termios};
use tokio::io::AsyncReadExt;
use tokio::signal::unix::{signal, SignalKind};
use tokio_tungstenite::tungstenite::Message;

use crate::output::{chunk_bytes, write_out};
use crate::parse::exit_code;

/// `moat shell ID [--user U] [CMD...]`: `/bin/bash -l` unless a command is given.
pub async fn shell(
    client: &Client,
    id: &str,
    user: Option<String>,
    cmd: Vec<String>,
) -> anyhow::Result<i32> {
    let cmd = if cmd.is_empty() {
        vec!["/bin/bash".to_string(), "-l".to_string()]
    } else {
        cmd
    };
    let req = StartProcessRequest {
        cmd: Some(cmd),
        user,
        ..Default::default()
    };
    run_pty(client, id, req).await
}

/// Starts `req` on a PTY sized like our terminal, attaches its WebSocket and relays the terminal
/// (raw mode while it runs) until the process exits; returns its exit code.
pub async fn run_pty(
    client: &Client,
    id: &str,
    mut req: StartProcessRequest,
) -> anyhow::Result<i32> {
    req.pty = Some(terminal_size().unwrap_or(PtySize { cols: 80, rows: 24 }));
    req.stdin = true;
    req.background = true;
    let info = client.start_process_background(id, &req).await?;
    let sel = info.pid.to_string();
    let ws = client.attach_ws(id, &sel).await?;
    let raw = RawMode::enable()?;
    let result = relay(ws).await;
    drop(raw);
    match result? {
        Some(code) => Ok(code),
        None => {
            // The socket closed without an exit event: ask the daemon how the process ended.
            let procs = client.list_processes(id).await?;
            match procs
                .iter()
                .find(|p| p.pid == info.pid)
                .and_then(|p| p.exit.as_ref())
            {
                Some(status) => Ok(exit_code(status)),
                None => anyhow::bail!("the connection closed before process {} exited", info.pid),
            }
        }
    }
}

/// Relays until the exit event (`Some(code)`) or the socket closes (`None`).
async fn relay(ws: moat_client::WsStream) -> anyhow::Result<Option<i32>> {
    let (mut tx, mut rx) = ws.split();
    let mut stdin = tokio::io::stdin();
    let mut stdin_open = true;
    let mut buf = vec![0u8; 16 * 1024];
    let mut winch = signal(SignalKind::window_change())?;
    loop {
        tokio::select! {
            msg = rx.next() => {
                let Some(msg) = msg else { return Ok(None) };
                match msg? {
                    Message::Binary(data) => write_out(&mut std::io::stdout().lock(), &data)?,
                    Message::Text(text) => match serde_json::from_str::<ProcessEvent>(&text) {
                        Ok(ProcessEvent::Exit(status)) => {
                            if let Some(err) = &status.error {
                                eprint!("error: {err}\r\n");
                            }
                            return Ok(Some(exit_code(&status)));
                        }
                        Ok(ProcessEvent::Pty(c) | ProcessEvent::Stdout(c) | ProcessEvent::Stderr(c)) => {
                            write_out(&mut std::io::stdout().lock(), &chunk_bytes(&c)?)?;
                        }
                        _ => {}
                    },
                    Message::Close(_) => return Ok(None),
                    _ => {}
                }
            }
            n = stdin.read(&mut buf), if stdin_open => match n {
                Ok(n) if n > 0 => tx.send(Message::binary(buf[..n].to_vec())).await?,
                _ => {
                    stdin_open = false;
                    tx.send(Message::text(r#"{"type":"close_stdin"}"#.to_string())).await?;
                }
            },
            _ = winch.recv() => {
                if let Some(size) = terminal_size() {
                    let msg = serde_json::json!({"type": "resize", "cols": size.cols, "rows": size.rows});
                    tx.send(Message::text(msg.to_string())).await?;
                }
            }
        }
    }
}

/// The size of our terminal (stdout, else stdin), if either is one.
fn terminal_size() -> Option<PtySize> {
    [libc::STDOUT_FILENO, libc::STDIN_FILENO]
        .into_iter()
        .find_map(|fd| {
            let mut ws = libc::winsize {
                ws_row: 0,
                ws_col: 0,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            // SAFETY: TIOCGWINSZ only writes a `winsize` into the valid, exclusively borrowed `ws`;
            // a non-terminal fd makes it fail with ENOTTY, which is checked.
            let rc = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) };
            (rc == 0 && ws.ws_col > 0 && ws.ws_row > 0).then_some(PtySize {
                cols: ws.ws_col,
                rows: ws.ws_row,
            })
        })
}

/// Puts the terminal on stdin in raw mode; restores the saved settings when dropped.
struct RawMode {
    saved: Termios,
}

impl RawMode {
    /// `None` when stdin is not a terminal (nothing to change).
    fn enable() -> anyhow::Result<Option<RawMode>> {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return Ok(None);
        }
        let saved = termios::tcgetattr(&stdin)?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(&stdin, SetArg::TCSANOW, &raw)?;
        Ok(Some(RawMode { saved }))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(std::io::stdin(), SetArg::TCSANOW, &self.saved);
    }
}
