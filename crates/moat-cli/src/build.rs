//! Template builds from a spec: `moat template build NAME -f moat.toml`, `builds`, `inspect`, `logs`.

use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use moat_api::{Build, BuildEvent, StepStatus};
use moat_client::{Client, EventStream};

use crate::output::{print_json, print_table};
use crate::template::human_size;

/// Builds `name` from the spec in `file`, sending the files its `copy` steps take from `context` (the
/// spec's directory by default).
pub async fn from_spec(
    client: &Client,
    name: &str,
    file: &std::path::Path,
    context: Option<&std::path::Path>,
    no_cache: bool,
    quiet: bool,
    json: bool,
) -> anyhow::Result<i32> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| anyhow::anyhow!("read {}: {e}", file.display()))?;
    let spec: moat_api::TemplateSpec =
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    if let Err((field, msg)) = spec.validate() {
        anyhow::bail!("{}: {field}: {msg}", file.display());
    }
    let dir = match context {
        Some(d) => d.to_path_buf(),
        None => std::path::absolute(file)?
            .parent()
            .map(std::path::Path::to_path_buf)
            .unwrap_or_else(|| ".".into()),
    };
    let tar =
        tokio::task::spawn_blocking(move || moat_client::context_tar(&dir, &text, &spec)).await??;
    let events = client
        .build_template_context(name, tar, None, no_cache)
        .await?;
    render(events, quiet, json).await
}

/// Shows a build's events: one line per step (cached or how long it took), the output unless
/// `quiet`, a spinner on the running step (with the phase and counts of a debootstrap build). Exit
/// code 1 when the build failed.
pub async fn render(
    mut events: EventStream<BuildEvent>,
    quiet: bool,
    json: bool,
) -> anyhow::Result<i32> {
    let bar = if json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new_spinner()
    };
    bar.set_style(ProgressStyle::with_template("{spinner} {msg} {elapsed}")?);
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    let mut current = String::new();
    let mut id = String::new();
    while let Some(ev) = events.next().await {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                bar.finish_and_clear();
                return Err(e.into());
            }
        };
        if json {
            println!("{}", serde_json::to_string(&ev)?);
        }
        match ev {
            BuildEvent::Started(s) => {
                id = s.build.id.clone();
                say(
                    &bar,
                    json,
                    format!(
                        "building template {} ({}, {} steps)",
                        s.build.template,
                        s.build.id,
                        s.build.steps.len()
                    ),
                );
            }
            BuildEvent::Step {
                index,
                total,
                description,
                cached,
            } => {
                current = format!("[{index}/{}] {description}", total.saturating_sub(1));
                if cached {
                    say(&bar, json, format!("{current}  CACHED"));
                } else if bar.is_hidden() {
                    // No spinner: the step's title goes before its output.
                    say(&bar, json, &current);
                } else {
                    bar.reset_elapsed();
                    bar.set_message(current.clone());
                }
            }
            BuildEvent::StepDone {
                duration_ms,
                layer,
                size_bytes,
                ..
            } => {
                if !current.is_empty() && duration_ms > 0 {
                    let made = match layer {
                        Some(_) => format!(", {}", human_size(size_bytes)),
                        None => String::new(),
                    };
                    say(
                        &bar,
                        json,
                        format!(
                            "{current}  done in {:.1}s{made}",
                            duration_ms as f64 / 1000.0
                        ),
                    );
                } else if !current.is_empty() && !bar.message().is_empty() {
                    say(&bar, json, format!("{current}  done"));
                }
                bar.set_message("");
            }
            BuildEvent::Log { line, .. } if !quiet => say(&bar, json, format!("    {line}")),
            BuildEvent::Progress { phase, done, total } => {
                let counts = if total > 0 {
                    format!(" {done}/{total}")
                } else {
                    String::new()
                };
                let sep = if current.is_empty() { "" } else { ": " };
                bar.set_message(format!("{current}{sep}{phase}{counts}"));
            }
            BuildEvent::Done { template } => {
                bar.finish_and_clear();
                if !json {
                    let layers = match template.layers.len() {
                        0 => String::new(),
                        n => format!("{n} layers, "),
                    };
                    println!(
                        "template {} ready ({layers}{})",
                        template.name,
                        human_size(template.size_bytes)
                    );
                }
                return Ok(0);
            }
            BuildEvent::Failed { message, .. } => {
                bar.finish_and_clear();
                let what = if id.is_empty() {
                    "template build".to_string()
                } else {
                    format!("build {id}")
                };
                eprintln!("error: {what} failed: {message}");
                return Ok(1);
            }
            _ => {}
        }
    }
    bar.finish_and_clear();
    anyhow::bail!("the build stream ended without a result")
}

/// A line above the spinner (or plainly, when stderr is no terminal and the spinner is hidden).
fn say(bar: &ProgressBar, json: bool, line: impl AsRef<str>) {
    if json {
        return;
    }
    if bar.is_hidden() {
        println!("{}", line.as_ref());
    } else {
        bar.println(line);
    }
}

pub async fn list(
    client: &Client,
    template: Option<&str>,
    limit: u32,
    json: bool,
) -> anyhow::Result<i32> {
    let builds = client.list_builds(template, limit).await?;
    if json {
        print_json(&builds)?;
        return Ok(0);
    }
    let rows: Vec<Vec<String>> = builds
        .iter()
        .map(|b| {
            let cached = b
                .steps
                .iter()
                .filter(|s| s.status == StepStatus::Cached)
                .count();
            vec![
                b.id.clone(),
                b.template.clone(),
                b.status.as_str().to_string(),
                format!("{} ({cached} cached)", b.steps.len()),
                b.started_at.clone(),
            ]
        })
        .collect();
    print_table(&["ID", "TEMPLATE", "STATUS", "STEPS", "STARTED"], &rows);
    Ok(0)
}

pub async fn inspect(client: &Client, id: &str, json: bool) -> anyhow::Result<i32> {
    let b: Build = client.get_build(id).await?;
    if json {
        print_json(&b)?;
        return Ok(0);
    }
    println!(
        "build {} of template {}: {}",
        b.id,
        b.template,
        b.status.as_str()
    );
    let rows: Vec<Vec<String>> = b
        .steps
        .iter()
        .map(|s| {
            vec![
                s.index.to_string(),
                s.description.clone(),
                format!("{:?}", s.status).to_lowercase(),
                s.duration_ms
                    .map(|ms| format!("{:.1}s", ms as f64 / 1000.0))
                    .unwrap_or_default(),
                s.layer
                    .as_deref()
                    .map(|l| l.get(7..19).unwrap_or(l).to_string())
                    .unwrap_or_default(),
                s.size_bytes.map(human_size).unwrap_or_default(),
            ]
        })
        .collect();
    print_table(&["STEP", "WHAT", "STATUS", "TOOK", "LAYER", "SIZE"], &rows);
    if let Some(e) = &b.error {
        println!("error: {e}");
    }
    Ok(0)
}

pub async fn logs(client: &Client, id: &str, quiet: bool, json: bool) -> anyhow::Result<i32> {
    let events = client.build_events(id).await?;
    render(events, quiet, json).await
}
