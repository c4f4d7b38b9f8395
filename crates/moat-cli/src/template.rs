//! Template commands: ls, build, add, rm.

use moat_api::{RegisterTemplateRequest, Template};
use moat_client::Client;

use crate::cli::TemplateCommand;
use crate::output::{print_json, print_table};

pub async fn dispatch(client: &Client, cmd: TemplateCommand, json: bool) -> anyhow::Result<i32> {
    match cmd {
        TemplateCommand::Ls => list(client, json).await,
        TemplateCommand::Build {
            name,
            file: Some(file),
            context,
            no_cache,
            quiet,
            ..
        } => {
            crate::build::from_spec(
                client,
                &name,
                &file,
                context.as_deref(),
                no_cache,
                quiet,
                json,
            )
            .await
        }
        TemplateCommand::Build { name, verbose, .. } => build(client, &name, verbose, json).await,
        TemplateCommand::Builds { name, limit } => {
            crate::build::list(client, name.as_deref(), limit, json).await
        }
        TemplateCommand::Inspect { id } => crate::build::inspect(client, &id, json).await,
        TemplateCommand::Logs { id, quiet } => crate::build::logs(client, &id, quiet, json).await,
        TemplateCommand::Cancel { id } => {
            let b = client.cancel_build(&id).await?;
            if json {
                print_json(&b)?;
            } else {
                println!("cancelling {id}");
            }
            Ok(0)
        }
        TemplateCommand::Add { name, path } => {
            let path = std::path::absolute(&path)?;
            let path = path
                .to_str()
                .ok_or_else(|| anyhow::anyhow!("{} is not valid UTF-8", path.display()))?
                .to_string();
            let t = client
                .register_template(&RegisterTemplateRequest { name, path })
                .await?;
            print_template(&t, json)?;
            Ok(0)
        }
        TemplateCommand::Pull {
            name,
            image,
            username,
            password,
            insecure,
        } => {
            let t = client
                .pull_template(
                    &name,
                    &moat_api::PullTemplateRequest {
                        image,
                        username,
                        password,
                        insecure,
                    },
                )
                .await?;
            print_template(&t, json)?;
            Ok(0)
        }
        TemplateCommand::Rm { name } => {
            client.delete_template(&name).await?;
            if json {
                print_json(&serde_json::json!({ "deleted": name }))?;
            } else {
                println!("{name}");
            }
            Ok(0)
        }
    }
}

fn print_template(t: &Template, json: bool) -> anyhow::Result<()> {
    if json {
        print_json(t)
    } else {
        println!("{} {}", t.name, status(t));
        Ok(())
    }
}

fn status(t: &Template) -> &'static str {
    match t.status {
        moat_api::TemplateStatus::Building => "building",
        moat_api::TemplateStatus::Ready => "ready",
        moat_api::TemplateStatus::Failed => "failed",
    }
}

async fn list(client: &Client, json: bool) -> anyhow::Result<i32> {
    let templates = client.list_templates().await?;
    if json {
        print_json(&templates)?;
        return Ok(0);
    }
    let rows: Vec<Vec<String>> = templates
        .iter()
        .map(|t| {
            vec![
                t.name.clone(),
                format!("{:?}", t.source).to_lowercase(),
                status(t).to_string(),
                human_size(t.size_bytes),
                t.created_at.clone(),
            ]
        })
        .collect();
    print_table(&["NAME", "SOURCE", "STATUS", "SIZE", "CREATED"], &rows);
    Ok(0)
}

/// `1.5 MiB` style sizes.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

async fn build(client: &Client, name: &str, verbose: bool, json: bool) -> anyhow::Result<i32> {
    let events = client.build_template(name).await?;
    crate::build::render(events, !verbose, json).await
}

/// `moat system prune`: empties the build cache.
pub async fn prune(client: &Client, json: bool) -> anyhow::Result<i32> {
    let r = client.prune_build_cache().await?;
    if json {
        print_json(&r)?;
    } else {
        println!(
            "removed {} build cache entries and {} layers",
            r.entries, r.layers
        );
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(human_size(12), "12 B");
        assert_eq!(human_size(1536), "1.5 KiB");
        assert_eq!(human_size(3 * 1024 * 1024 * 1024), "3.0 GiB");
    }
}
