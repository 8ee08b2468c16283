//! The typed confirmation every command that gives up data asks for (`detach --force`, `serve
//! --accept-new-backing --discard-dirty`, `forget-lost`): a word typed on the terminal, or the
//! command's own `--yes...` flag. Without a terminal and without the flag, nothing happens: a
//! script that forgot the flag must not lose data by default.

use std::io::{BufRead, IsTerminal, Write};

/// Asks the operator to type `word` to go ahead with `action` (e.g. "discard the dirty data and
/// detach"); `without_terminal` says what to do instead when stdin is not a terminal (the flag
/// that confirms, or the safe alternative).
pub fn typed(word: &str, action: &str, without_terminal: &str) -> anyhow::Result<()> {
    if !std::io::stdin().is_terminal() {
        anyhow::bail!("refusing to {action} without confirmation: stdin is not a terminal. {without_terminal}");
    }
    eprint!("flashtier: type `{word}` to {action}: ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    if answer.trim() != word {
        anyhow::bail!("not confirmed; nothing was changed");
    }
    Ok(())
}
