//! `moat code`: run a cell in a sandbox's code interpreter and print what it produced.

use std::io::{Read, Write};
use std::path::PathBuf;

use base64::Engine;
use clap::Args;
use futures::StreamExt;
use moat_api::{CodeEvent, CodeLanguage, CodeResult, RunCodeRequest};
use moat_client::Client;

use crate::output::print_json;
use crate::parse::parse_kv;

#[derive(Debug, Args)]
pub struct CodeArgs {
    pub id: String,
    /// python, javascript or bash (the language's default context); default python.
    #[arg(long, short = 'l', value_parser = parse_language)]
    pub language: Option<CodeLanguage>,
    /// A context id from the API (`POST .../code/contexts`).
    #[arg(long, short = 'c')]
    pub context: Option<String>,
    /// Interrupt the cell after SECS seconds (the context keeps its state); default 60.
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<f64>,
    /// Environment variable for this cell (repeatable).
    #[arg(long, short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Where images (png, svg) are saved; the system's temp directory by default.
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
    /// The code; read from stdin when absent.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CODE"
    )]
    pub code: Vec<String>,
}

fn parse_language(s: &str) -> Result<CodeLanguage, String> {
    serde_json::from_value(serde_json::Value::String(s.to_ascii_lowercase()))
        .map_err(|_| format!("unknown language {s:?} (python, javascript, bash)"))
}

/// Runs the cell; exits 1 when it raised an error.
pub async fn run(client: &Client, args: &CodeArgs, json: bool) -> anyhow::Result<i32> {
    let code = if args.code.is_empty() {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s)?;
        s
    } else {
        args.code.join(" ")
    };
    let req = RunCodeRequest {
        code,
        language: args.language,
        context_id: args.context.clone(),
        timeout: args.timeout,
        env: args.env.iter().cloned().collect(),
    };
    let mut events = client.run_code(&args.id, &req).await?;
    let out_dir = args.out_dir.clone().unwrap_or_else(std::env::temp_dir);
    let mut failed = false;
    let mut images = 0usize;
    while let Some(ev) = events.next().await {
        let ev = ev?;
        if json {
            print_json(&ev)?;
            if matches!(ev, CodeEvent::Error(_)) {
                failed = true;
            }
            continue;
        }
        match ev {
            CodeEvent::Stdout { data } => {
                let mut o = std::io::stdout();
                o.write_all(data.as_bytes())?;
                o.flush()?;
            }
            CodeEvent::Stderr { data } => {
                let mut e = std::io::stderr();
                e.write_all(data.as_bytes())?;
                e.flush()?;
            }
            CodeEvent::Result(r) => print_result(&r, &out_dir, &mut images)?,
            CodeEvent::Error(e) => {
                failed = true;
                if e.traceback.is_empty() {
                    eprintln!("{}: {}", e.name, e.value);
                } else {
                    eprint!("{}", e.traceback);
                    if !e.traceback.ends_with('\n') {
                        eprintln!();
                    }
                }
            }
            CodeEvent::End { .. } => {}
        }
    }
    Ok(if failed { 1 } else { 0 })
}

fn print_result(r: &CodeResult, dir: &std::path::Path, n: &mut usize) -> anyhow::Result<()> {
    let mut saved = false;
    if let Some(png) = &r.png {
        let bytes = base64::engine::general_purpose::STANDARD.decode(png)?;
        saved = true;
        println!(
            "[image saved to {}]",
            save(dir, n, "png", &bytes)?.display()
        );
    }
    if let Some(svg) = &r.svg {
        saved = true;
        println!(
            "[image saved to {}]",
            save(dir, n, "svg", svg.as_bytes())?.display()
        );
    }
    if !saved {
        if let Some(text) = r.text.as_ref().or(r.markdown.as_ref()).or(r.html.as_ref()) {
            println!("{text}");
        } else if let Some(j) = &r.json {
            println!("{j}");
        }
    }
    Ok(())
}

fn save(dir: &std::path::Path, n: &mut usize, ext: &str, bytes: &[u8]) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    loop {
        *n += 1;
        let path = dir.join(format!("moat-result-{}-{}.{ext}", std::process::id(), *n));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(mut f) => {
                f.write_all(bytes)?;
                return Ok(path);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(anyhow::anyhow!("{}: {e}", path.display())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn languages() {
        assert_eq!(parse_language("Python").unwrap(), CodeLanguage::Python);
        assert_eq!(parse_language("bash").unwrap(), CodeLanguage::Bash);
        assert!(parse_language("ruby").is_err());
    }
}
