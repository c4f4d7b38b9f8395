//! Process commands: exec, run, ps, kill.

use futures::StreamExt;
use moat_api::{ErrorCode, ProcessEvent, ProcessInfo, StartProcessRequest};
use moat_client::Client;
use tokio::signal::unix::{signal, SignalKind};

use crate::cli::{ExecArgs, ProcessOpts, RunArgs};
use crate::output::{chunk_bytes, print_json, print_table, write_out};
use crate::parse::exit_code;
use crate::sandbox::create_request;
use crate::shell;

/// The start request for these flags (argv, never a shell string).
pub fn process_request(
    opts: &ProcessOpts,
    env: &[(String, String)],
    timeout: Option<f64>,
    cmd: &[String],
) -> StartProcessRequest {
    StartProcessRequest {
        cmd: Some(cmd.to_vec()),
        cwd: opts.cwd.clone(),
        env: env.iter().cloned().collect(),
        user: opts.user.clone(),
        timeout,
        stdin: opts.stdin,
        tag: opts.tag.clone(),
        ..Default::default()
    }
}

pub async fn exec(client: &Client, args: &ExecArgs, json: bool) -> anyhow::Result<i32> {
    let req = process_request(&args.opts, &args.env, args.timeout, &args.cmd);
    if args.detach {
        let info = client.start_process_background(&args.id, &req).await?;
        if json {
            print_json(&info)?;
        } else {
            println!("{}", info.pid);
        }
        return Ok(0);
    }
    run_foreground(client, &args.id, req, &args.opts).await
}

pub async fn run(client: &Client, args: &RunArgs) -> anyhow::Result<i32> {
    let create = create_request(&args.create)?;
    let req = process_request(&args.opts, &[], args.cmd_timeout, &args.cmd);
    let sbx = client.create_sandbox(&create).await?;
    let result = run_foreground(client, &sbx.id, req, &args.opts).await;
    if let Err(e) = client.delete_sandbox(&sbx.id).await {
        eprintln!("error: deleting sandbox {}: {e}", sbx.id);
    }
    result
}

/// Runs a process in the foreground (on a PTY with `-t`) and returns its exit code.
async fn run_foreground(
    client: &Client,
    id: &str,
    req: StartProcessRequest,
    opts: &ProcessOpts,
) -> anyhow::Result<i32> {
    if opts.tty {
        return shell::run_pty(client, id, req).await;
    }
    stream_process(client, id, req).await
}

/// Streams a process's output to our stdout/stderr; with `req.stdin` pipes our stdin to it.
/// Ctrl-C sends SIGINT to the process (a third Ctrl-C gives up waiting).
async fn stream_process(
    client: &Client,
    id: &str,
    mut req: StartProcessRequest,
) -> anyhow::Result<i32> {
    req.background = false;
    let pipe_stdin = req.stdin;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut events = client.start_process_stream(id, &req).await?;
    let mut pid: Option<String> = None;
    let mut interrupts = 0u32;
    loop {
        tokio::select! {
            ev = events.next() => {
                let ev = match ev {
                    None => anyhow::bail!("the event stream ended before the process exited"),
                    Some(ev) => ev?,
                };
                match ev {
                    ProcessEvent::Start { pid: p, .. } => {
                        let sel = p.to_string();
                        if pipe_stdin {
                            spawn_stdin_pump(client.clone(), id.to_string(), sel.clone());
                        }
                        pid = Some(sel);
                    }
                    ProcessEvent::Stdout(c) | ProcessEvent::Pty(c) => {
                        write_out(&mut std::io::stdout().lock(), &chunk_bytes(&c)?)?;
                    }
                    ProcessEvent::Stderr(c) => {
                        write_out(&mut std::io::stderr().lock(), &chunk_bytes(&c)?)?;
                    }
                    ProcessEvent::Dropped { bytes } => {
                        eprintln!("moat: {bytes} bytes of output were dropped");
                    }
                    ProcessEvent::Exit(status) => {
                        if let Some(err) = &status.error {
                            eprintln!("error: {err}");
                        }
                        return Ok(exit_code(&status));
                    }
                    ProcessEvent::Error { message } => anyhow::bail!("{message}"),
                }
            }
            _ = sigint.recv() => {
                interrupts += 1;
                if interrupts >= 3 {
                    eprintln!("moat: interrupted; the process may still be running");
                    return Ok(130);
                }
                if let Some(sel) = &pid {
                    let (c, id, sel) = (client.clone(), id.to_string(), sel.clone());
                    tokio::spawn(async move {
                        if let Err(e) = c.signal(&id, &sel, "SIGINT").await {
                            eprintln!("error: sending SIGINT: {e}");
                        }
                    });
                }
            }
        }
    }
}

/// Streams our stdin to the process, then closes its stdin at EOF. Errors after the process ended
/// (not found / conflict) are expected and not reported.
fn spawn_stdin_pump(client: Client, id: String, sel: String) {
    tokio::spawn(async move {
        let body =
            reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(tokio::io::stdin()));
        let result = match client.send_stdin_body(&id, &sel, body).await {
            Ok(()) => client.close_stdin(&id, &sel).await,
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            if !matches!(e.code(), Some(ErrorCode::NotFound | ErrorCode::Conflict)) {
                eprintln!("error: sending stdin: {e}");
            }
        }
    });
}

pub async fn ps(client: &Client, id: &str, json: bool) -> anyhow::Result<i32> {
    let procs = client.list_processes(id).await?;
    if json {
        print_json(&procs)?;
        return Ok(0);
    }
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0);
    let rows: Vec<Vec<String>> = procs.iter().map(|p| ps_row(p, now_us)).collect();
    print_table(
        &["PID", "TAG", "STATUS", "USER", "PTY", "STARTED", "COMMAND"],
        &rows,
    );
    Ok(0)
}

fn ps_row(p: &ProcessInfo, now_us: u64) -> Vec<String> {
    let status = if p.running {
        "running".to_string()
    } else {
        match &p.exit {
            Some(st) if st.timed_out => "timed out".to_string(),
            Some(st) => match (&st.exit_code, &st.signal, &st.error) {
                (Some(c), _, _) => format!("exited {c}"),
                (None, Some(s), _) => format!("killed {s}"),
                (None, None, Some(_)) => "failed".to_string(),
                _ => "exited".to_string(),
            },
            None => "exited".to_string(),
        }
    };
    vec![
        p.pid.to_string(),
        p.tag.clone().unwrap_or_default(),
        status,
        p.user.clone(),
        if p.pty { "yes" } else { "no" }.to_string(),
        format!(
            "{} ago",
            age(now_us.saturating_sub(p.started_at_us) / 1_000_000)
        ),
        p.cmd.join(" "),
    ]
}

/// `42s`, `5m`, `3h`, `2d`.
fn age(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m", s / 60),
        s if s < 86_400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

pub async fn kill(client: &Client, id: &str, sel: &str, sig: &str) -> anyhow::Result<i32> {
    client.signal(id, sel, sig).await?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages() {
        assert_eq!(age(5), "5s");
        assert_eq!(age(125), "2m");
        assert_eq!(age(7200), "2h");
        assert_eq!(age(200_000), "2d");
    }

    #[test]
    fn request_is_argv() {
        let opts = ProcessOpts {
            cwd: Some("/tmp".into()),
            user: None,
            stdin: true,
            tty: false,
            tag: None,
        };
        let req = process_request(
            &opts,
            &[("A".into(), "1".into())],
            Some(2.0),
            &["echo hi".to_string()],
        );
        assert_eq!(req.cmd, Some(vec!["echo hi".to_string()]));
        assert!(req.command.is_none());
        assert!(req.stdin);
        assert_eq!(req.env.get("A").map(String::as_str), Some("1"));
    }
}
