//! The tables of `docs/` that are printed from the code, so that each fact is stated once, where
//! the code keeps it: the settings (from their clap definitions, `walletlock settings`), the
//! error codes (from [`crate::http::error::codes`], `walletlock error-codes`) and the metrics
//! (from [`crate::telemetry::metrics`], `walletlock metrics`). A page holds its
//! table between two marker comments; `--write` puts a fresh one there, and a test below fails
//! while a page differs from what its command prints.

use anyhow::Context;

/// A table generated into one page of `docs/`.
pub struct GeneratedTable {
    /// The name in the page's markers: `<!-- {marker}:begin -->` and `<!-- {marker}:end -->`.
    pub marker: &'static str,
    /// The page, from the repository's root.
    pub page: &'static str,
    /// The `walletlock` subcommand that prints it.
    pub command: &'static str,
}

pub const SETTINGS: GeneratedTable =
    GeneratedTable { marker: "settings", page: "docs/operating/settings.md", command: "settings" };

pub const ERROR_CODES: GeneratedTable =
    GeneratedTable { marker: "error-codes", page: "docs/api/errors.md", command: "error-codes" };

pub const METRICS: GeneratedTable =
    GeneratedTable { marker: "metrics", page: "docs/operating/observability.md", command: "metrics" };

impl GeneratedTable {
    fn markers(&self) -> (String, String) {
        (format!("<!-- {}:begin -->\n", self.marker), format!("<!-- {}:end -->", self.marker))
    }

    /// Where the table stands in `page`: the byte range between the two markers.
    fn range_in(&self, page: &str) -> anyhow::Result<std::ops::Range<usize>> {
        let (begin, end) = self.markers();
        let start = page.find(&begin).with_context(|| format!("{} has no `{}`", self.page, begin.trim()))?
            + begin.len();
        let stop = page[start..].find(&end).with_context(|| format!("{} has no `{end}`", self.page))? + start;
        Ok(start..stop)
    }

    /// The table `page` holds now.
    pub fn current_in<'a>(&self, page: &'a str) -> anyhow::Result<&'a str> {
        Ok(&page[self.range_in(page)?])
    }

    /// `page` with `table` between the markers instead of what stood there.
    pub fn replaced_in(&self, page: &str, table: &str) -> anyhow::Result<String> {
        let range = self.range_in(page)?;
        Ok(format!("{}{table}{}", &page[..range.start], &page[range.end..]))
    }

    /// Puts `table` into the page, read from and written to the current directory (the
    /// repository's root).
    pub fn write(&self, table: &str) -> anyhow::Result<()> {
        let page = std::fs::read_to_string(self.page).with_context(|| format!("reading {}", self.page))?;
        std::fs::write(self.page, self.replaced_in(&page, table)?)
            .with_context(|| format!("writing {}", self.page))
    }

    /// How to bring the page up to date, for a test's failure.
    pub fn regenerate_with(&self) -> String {
        format!(
            "{} differs from what `walletlock {}` prints: regenerate it with \
             `cargo run -q -- {} --write` from the repository's root",
            self.page, self.command, self.command
        )
    }
}

/// One setting: an argument with an environment variable.
struct Setting {
    id: String,
    variable: String,
    flag: String,
    default: String,
    commands: Vec<String>,
    meaning: String,
}

/// The settings table of `docs/operating/settings.md`: every argument of `cli` and its
/// subcommands that has an environment variable (the rest, such as `probe --timeout`, are
/// command-line options, not settings), in the order the commands declare them, with the commands
/// that take it. The meaning is the argument's help, as `--help` prints it.
pub fn settings_table(cli: &clap::Command) -> String {
    let mut settings: Vec<Setting> = Vec::new();
    let every = || vec!["every command".to_owned()];
    let global = cli.get_arguments().map(|arg| (arg, every()));
    let of_subcommands = cli
        .get_subcommands()
        .flat_map(|sub| sub.get_arguments().map(move |arg| (arg, vec![format!("`{}`", sub.get_name())])));
    for (arg, commands) in global.chain(of_subcommands) {
        let Some(variable) = arg.get_env() else { continue };
        let id = arg.get_id().to_string();
        if let Some(known) = settings.iter_mut().find(|setting| setting.id == id) {
            known.commands.extend(commands);
            continue;
        }
        let flag = match arg.get_long() {
            Some(long) => format!("`--{long}`"),
            None => format!("`<{}>` (argument)", id.to_uppercase()),
        };
        let defaults: Vec<String> =
            arg.get_default_values().iter().map(|value| format!("`{}`", value.to_string_lossy())).collect();
        let default = match (defaults.is_empty(), arg.is_required_set()) {
            (false, _) => defaults.join(", "),
            (true, true) => "(required)".to_owned(),
            (true, false) => String::new(),
        };
        let help = arg.get_long_help().or(arg.get_help()).map(|help| help.to_string()).unwrap_or_default();
        let mut meaning = help.split_whitespace().collect::<Vec<_>>().join(" ");
        // clap drops the full stop of a one-paragraph help; the table's cells are sentences.
        if !meaning.is_empty() && !meaning.ends_with('.') {
            meaning.push('.');
        }
        let values: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|value| !value.is_hide_set())
            .map(|value| format!("`{}`", value.get_name()))
            .collect();
        if !values.is_empty() {
            meaning.push_str(&format!(" One of {}.", values.join(", ")));
        }
        settings.push(Setting {
            id,
            variable: format!("`{}`", variable.to_string_lossy()),
            flag,
            default,
            commands,
            meaning: meaning.replace('|', "\\|"),
        });
    }
    let mut table =
        String::from("| variable | flag | default | commands | meaning |\n|---|---|---|---|---|\n");
    for setting in settings {
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            setting.variable,
            setting.flag,
            setting.default,
            setting.commands.join(", "),
            setting.meaning
        ));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn assert_page_holds(generated: &GeneratedTable, page: &str, table: &str) {
        let current = generated.current_in(page).unwrap_or_else(|err| panic!("{err:#}"));
        assert!(current == table, "{}", generated.regenerate_with());
    }

    #[test]
    fn the_settings_page_holds_the_settings_as_the_code_declares_them() {
        let page = include_str!("../docs/operating/settings.md");
        assert_page_holds(&SETTINGS, page, &settings_table(&crate::cli::Cli::command()));
    }

    #[test]
    fn the_errors_page_holds_every_code_the_code_lists() {
        let page = include_str!("../docs/api/errors.md");
        assert_page_holds(&ERROR_CODES, page, &crate::http::error::codes::markdown_table());
    }

    #[test]
    fn the_observability_page_holds_every_metric_the_code_declares() {
        let page = include_str!("../docs/operating/observability.md");
        assert_page_holds(&METRICS, page, &crate::telemetry::metrics::markdown_table());
    }

    #[test]
    fn every_setting_has_a_meaning_and_a_flag() {
        let table = settings_table(&crate::cli::Cli::command());
        for row in table.lines().skip(2) {
            assert!(!row.ends_with("|  |"), "a setting without help: {row}");
        }
        for variable in ["`DATABASE_URL`", "`LEASE_TTL`", "`LOG_FORMAT`", "`APP_ROLE`", "`PROBE_URL`"] {
            assert!(table.contains(variable), "{variable} missing from\n{table}");
        }
    }

    #[test]
    fn a_table_is_replaced_between_its_markers_and_nowhere_else() {
        let page = "# Title\n\nbefore\n<!-- settings:begin -->\nold\n<!-- settings:end -->\nafter\n";
        let replaced = SETTINGS.replaced_in(page, "| new |\n").unwrap();
        assert_eq!(
            replaced,
            "# Title\n\nbefore\n<!-- settings:begin -->\n| new |\n<!-- settings:end -->\nafter\n"
        );
        assert_eq!(SETTINGS.current_in(&replaced).unwrap(), "| new |\n");
        assert!(ERROR_CODES.current_in(page).is_err());
    }
}
